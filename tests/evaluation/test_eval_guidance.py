"""``eval.guidance_scale``: evaluations sample with their own guidance (flow_grpo's
``sample.eval_guidance_scale``), training keeps the model's."""

import torch

from diffrl.training.trainer import Trainer
from tests.helpers import quick_config


def _evaluated(tmp_path, name, *overrides):
    # a reward that tells images apart on random weights (ShapeWorld's verifier scores 0)
    reward = 'rewards=[{"name": "jpeg_compressibility", "weight": 1.0}]'
    overrides = ("eval.every=1", "eval.num_prompts=2", reward, *overrides)
    trainer = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path / name, *overrides))
    return trainer, trainer.evaluate()


def test_evaluation_with_its_own_guidance_is_the_evaluation_of_a_model_at_that_guidance(tmp_path):
    """Training without CFG, evaluating at 3: the scores and samples are those of a model
    configured at 3 (negatives encoded for the evaluation only), not those at 1, and the
    model's own guidance is back afterwards."""
    own, scored = _evaluated(tmp_path, "own", "model.guidance_scale=1.0", "eval.guidance_scale=3.0")
    _, at_three = _evaluated(tmp_path, "three", "model.guidance_scale=3.0")
    _, at_one = _evaluated(tmp_path, "one", "model.guidance_scale=1.0")
    key = next(k for k in scored if k.endswith("/mean") and k.startswith("eval/"))
    assert scored[key] == at_three[key] and scored[key] != at_one[key]
    assert scored["eval/diversity"] == at_three["eval/diversity"]
    assert own.adapter.cfg.guidance_scale == 1.0 and not own.adapter.do_cfg
    # the training conditioning has no negatives, the evaluation's did
    cond = own.adapter.encode_prompts(["a red circle"])
    assert not any(k.startswith("negative_") for k in cond.tensors)
    with own.adapter.guidance_scale_as(3.0):
        guided = own.adapter.encode_prompts(["a red circle"])
    assert any(k.startswith("negative_") for k in guided.tensors)
    assert torch.equal(guided.tensors["prompt_embeds"], cond.tensors["prompt_embeds"])
