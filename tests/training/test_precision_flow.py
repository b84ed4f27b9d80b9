"""The FP8 precision flow in the training loop (precision: rollout / train): the replay
gap the trainer logs, LoRA and full fine-tuning through the quantizer."""

import json

import torch

from diffrl.training.trainer import Trainer

UNIFIED = ("precision.rollout=fp8", "precision.train=fp8", "precision.backend=reference")


def _rows(trainer):
    return [json.loads(line) for line in (trainer.cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.trainable_named_parameters()}


def test_replay_gap_is_zero_unified_and_not_naive(tiny_cfg, tmp_path):
    """The trainer's replay/logprob_gap (training forward against the sampled log-prob,
    before the first optimizer step): exactly 0 in BF16 and in the unified flow, clearly
    not in the naive split, at every trained step."""
    gaps = {}
    for name, sets in {
        "bf16": (),
        "naive": ("precision.rollout=fp8", "precision.backend=reference"),
        "unified": UNIFIED,
    }.items():
        out = f"output_dir={tmp_path / name}"
        trainer = Trainer(tiny_cfg("flux", "train.max_steps=1", "model.guidance_scale=1.0", out, *sets))
        trainer.fit()
        row = _rows(trainer)[-1]
        gaps[name] = [v for k, v in row.items() if k.startswith("replay/logprob_gap/step")]
        assert len(gaps[name]) == trainer.cfg.sampling.num_steps, row.keys()
    assert max(gaps["bf16"]) < 1e-6 and max(gaps["unified"]) < 1e-6, gaps
    assert min(gaps["naive"]) > 1e-5, gaps


def test_full_finetune_trains_through_the_quantizer(tiny_cfg):
    """Full fine-tuning: fp32 master weights move, and the frozen reference is quantized
    as the policy is, so the KL starts at exactly 0."""
    trainer = Trainer(tiny_cfg("flux", "model.full_finetune=true", "optim.lr=1e-4", *UNIFIED))
    assert trainer.precision.flow is not None and trainer.precision.flow.unified
    before = _params(trainer)
    history = trainer.fit()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert sum(not torch.equal(before[n], p) for n, p in _params(trainer).items()) > 0
    assert history[0]["kl"] == 0.0 and history[1]["kl"] > 0.0


def test_lora_trains_through_the_quantizer(tiny_cfg):
    trainer = Trainer(tiny_cfg("sana", *UNIFIED))  # SANA: LoRA on 1x1 convs too
    assert any("conv" in name for name in trainer.precision.flow.quantized)
    before = _params(trainer)
    trainer.fit()
    changed = [n for n, p in _params(trainer).items() if not torch.equal(before[n], p)]
    assert any("lora_B" in n for n in changed)
