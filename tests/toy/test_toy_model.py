"""The toy family: real library classes, the pipeline's own sampler as a second code
path, save/load and LoRA round trips, the shipped weights, and reproducible pretraining."""

from __future__ import annotations

import pytest
import torch

from diffrl.config import ModelConfig, load_config
from diffrl.models import ModelLoadError, build_adapter
from diffrl.models.toy import SHIPPED, ToyPipeline, word_tokenizer
from diffrl.sampling.rollout import rollout_independent
from rewards.shapeworld import grammar
from tests.helpers import assert_save_and_lora_round_trip

PROMPTS = ["two red circles", "a blue square to the left of a yellow triangle"]


def tiny_cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"family": "toy", "pretrained": "tiny", "height": 32, "width": 32, **kw})


def test_real_classes_and_pixel_space():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerBase

    adapter = build_adapter(tiny_cfg())
    pipe = adapter.pipe
    assert isinstance(pipe.transformer, SD3Transformer2DModel)
    assert isinstance(pipe.text_encoder, CLIPTextModelWithProjection)
    assert isinstance(pipe.tokenizer, PreTrainedTokenizerBase)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert adapter.latent_shape() == (3, 32, 32)
    x = torch.linspace(-3, 3, 3 * 32 * 32).view(1, 3, 32, 32)
    assert torch.equal(adapter.decode(x), ((x + 1) / 2).clamp(0, 1))


def test_word_tokenizer_covers_the_grammar_and_pools_at_eos():
    tok = word_tokenizer()
    for spec in grammar.all_specs():
        ids = tok(spec.caption()).input_ids
        assert tok.unk_token_id not in ids and ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert (
        len(tok(max((s.caption() for s in grammar.all_specs()), key=len)).input_ids) <= tok.model_max_length
    )
    adapter = build_adapter(tiny_cfg())
    assert (
        adapter.pipe.text_encoder.config.eos_token_id == tok.eos_token_id != 2
    )  # 2 = CLIP's legacy argmax path


def test_adapter_ode_rollout_matches_the_pipeline_sampler():
    """Two code paths: diffrl's rollout (adapter.velocity + ODE step) and ToyPipeline.__call__."""
    cfg = load_config("tiny_toy_flowgrpo", ["model.guidance_scale=2.0"])
    adapter = build_adapter(cfg.model)
    steps = 5
    cond = adapter.encode_prompts(PROMPTS)
    traj = rollout_independent(
        adapter, adapter.transformer, cond, [("k", 0), ("k", 1)], cfg, num_steps=steps, kinds=["ode"] * steps
    )
    images = adapter.pipe(
        PROMPTS, num_inference_steps=steps, guidance_scale=2.0, latents=traj.latents[:, 0], output_type="pt"
    )
    assert torch.allclose(images, traj.images, atol=1e-5)


def test_save_pretrained_round_trip_and_lora(tmp_path):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert_save_and_lora_round_trip(tmp_path, build_adapter, tiny_cfg(), ToyPipeline, x, PROMPTS)


def test_shipped_model_loads_by_name_and_checks_resolution():
    assert (SHIPPED / "model_index.json").is_file()
    weights = sum(f.stat().st_size for f in SHIPPED.rglob("*.safetensors"))
    assert weights < 20e6
    adapter = build_adapter(tiny_cfg(pretrained="shapeworld"))
    v = adapter.velocity(
        adapter.transformer,
        torch.zeros(1, 3, 32, 32),
        torch.tensor([0.5]),
        adapter.encode_prompts(PROMPTS[:1]),
    )
    assert torch.isfinite(v).all()
    with pytest.raises(ModelLoadError, match="set model.height and model.width to 32"):
        build_adapter(tiny_cfg(pretrained="shapeworld", height=64, width=64))


def test_pretraining_is_reproducible_and_stopping_early_equals_a_shorter_run(tmp_path):
    from diffrl.toy.pretrain import PretrainConfig, pretrain

    def run(name, steps, eval_every):
        cfg = PretrainConfig(
            out=str(tmp_path / name),
            steps=steps,
            batch_size=4,
            eval_every=eval_every,
            eval_prompts=2,
            eval_steps=2,
            snapshots=str(tmp_path / f"{name}-snap"),
        )
        pretrain(cfg, log=lambda *_: None)
        return ToyPipeline.from_pretrained(tmp_path / name).transformer.state_dict()

    short = run("a", 2, 2)
    again = run("b", 2, 2)
    longer = run("c", 3, 2)
    snap = ToyPipeline.from_pretrained(tmp_path / "c-snap" / "step-2").transformer.state_dict()
    assert all(torch.equal(short[k], again[k]) for k in short)
    assert all(torch.equal(short[k], snap[k]) for k in short)
    assert any(not torch.equal(short[k], longer[k]) for k in short)


def test_caption_noise_corrupts_that_share_of_scenes_and_each_violates_its_caption():
    import random

    from diffrl.toy.pretrain import scene_specs
    from rewards.shapeworld import detect, grammar, verify
    from rewards.shapeworld.render import render

    captions, _ = grammar.split()
    captions = captions[:400]
    assert scene_specs(captions, 0.0, random.Random(0)) == [grammar.parse(c) for c in captions]
    specs = scene_specs(captions, 0.3, random.Random(0))
    changed = [(c, s) for c, s in zip(captions, specs) if s != grammar.parse(c)]
    assert abs(len(changed) / len(captions) - 0.3) < 0.07  # binomial sd 0.023
    # the verifier (an independent reader of the pixels) fails every corrupted scene
    # against its caption, and passes the caption's own scene
    rnd = random.Random(1)
    images = [render(s, rnd) for _, s in changed[:40]] + [
        render(grammar.parse(c), rnd) for c, _ in changed[:40]
    ]
    pixels = torch.from_numpy(__import__("numpy").stack(images)).permute(0, 3, 1, 2).float() / 255
    verdicts = [verify(c, d).strict for (c, _), d in zip(changed[:40] * 2, detect(pixels))]
    assert verdicts[:40] == [0.0] * 40 and verdicts[40:] == [1.0] * 40


def test_pretraining_continues_from_init_and_noise_changes_only_the_scenes(tmp_path):
    from diffrl.toy.pretrain import PretrainConfig, pretrain

    def run(name, **kw):
        cfg = PretrainConfig(
            out=str(tmp_path / name), steps=1, batch_size=4, eval_every=1, eval_prompts=2, eval_steps=2, **kw
        )
        pretrain(cfg, log=lambda *_: None)
        return ToyPipeline.from_pretrained(tmp_path / name).transformer.state_dict()

    first = run("a")
    # one step from 'a' is a different model from two steps from scratch but starts at 'a':
    # with lr 0 it stays there exactly
    from_a = run("b", init=str(tmp_path / "a"), lr=0.0)
    assert all(torch.equal(first[k], from_a[k]) for k in first)
    noisy = run("c", caption_noise=0.9)
    assert any(not torch.equal(first[k], noisy[k]) for k in first)


def test_pretrain_script_rejects_bad_arguments_in_one_line(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_toy.py"
    spec = importlib.util.spec_from_file_location("pretrain_toy", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--resolution", "30", "--out", "/nonexistent"]) == 2
    assert capsys.readouterr().err.startswith("error: --resolution must be a multiple of 8")
    assert script.main(["--prediction", "eps"]) == 2
    assert "--prediction must be 'x0' or 'velocity'" in capsys.readouterr().err
    assert script.main(["--caption-noise", "1.5"]) == 2
    assert "--caption-noise must be in [0, 1)" in capsys.readouterr().err
    assert script.main(["--init", "/nonexistent/model"]) == 2
    assert "is not a saved toy model" in capsys.readouterr().err


def test_kind_weights_set_the_share_of_each_caption_kind_and_uniform_keeps_the_old_draws():
    import random
    from collections import Counter

    from diffrl.toy.pretrain import batch_captions

    train, _ = grammar.split()
    by_kind = [[p for p in train if grammar.parse(p).kind == k] for k in grammar.KINDS]
    kinds = Counter(
        grammar.parse(c).kind
        for c, _ in batch_captions(by_kind, random.Random(0), 3000, 0.0, [0.0, 1.0, 3.0])
    )
    assert kinds["count"] == 0
    assert abs(kinds["relation"] / 3000 - 0.75) < 0.03  # binomial sd 0.008
    # equal weights of any size replay the draws of the unweighted sampler exactly
    assert batch_captions(by_kind, random.Random(5), 50, 0.1, [2.0, 2.0, 2.0]) == batch_captions(
        by_kind, random.Random(5), 50, 0.1
    )


@pytest.mark.parametrize("weights", ["1,1", "1,-1,1", "0,0,0", "a,b,c"])
def test_pretrain_script_rejects_bad_kind_weights(weights, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_toy.py"
    spec = importlib.util.spec_from_file_location("pretrain_toy", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--kind-weights", weights, "--out", "/nonexistent"]) == 2
    assert (
        "--kind-weights must be 3 or 4 non-negative numbers for count, pair, relation, position"
        in capsys.readouterr().err
    )


def test_relation_probe_reads_placement_from_pixels_as_the_renderer_drew_it():
    import random

    import numpy as np

    from diffrl.toy import relation_probe as probe
    from rewards.shapeworld.render import render

    prompts = probe.relation_prompts("train", 24)
    rnd = random.Random(0)
    for relation, right, below in [
        ("to the left of", 1.0, None),
        ("to the right of", 0.0, None),
        ("above", None, 1.0),
        ("below", None, 0.0),
    ]:
        asked = [probe.with_relation(p, relation) for p in prompts]
        pixels = np.stack([render(grammar.parse(p), rnd, 32, 8) for p in asked])
        row = probe.placement(asked, torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255)
        assert row["n"] == 24  # every rendered object is found once
        assert row["b_right_of_a" if right is not None else "b_below_a"] == (
            right if right is not None else below
        )


def test_relation_probe_sensitivity_isolates_the_relation_word():
    from diffrl.models import tiny
    from diffrl.models.toy import build_components
    from diffrl.toy import relation_probe as probe

    with tiny.seeded(0):
        pipe = ToyPipeline(**build_components())
    prompts = probe.relation_prompts("heldout", 3)
    moved = probe.sensitivity(pipe, prompts)
    assert moved["first_colour"] > 0 and moved["relation_word"] > 0
    # a text encoder deaf to left/right makes the relation-word change exactly 0
    encode = pipe.text_embeddings
    pipe.text_embeddings = lambda captions: encode([c.replace(" right ", " left ") for c in captions])
    deaf = probe.sensitivity(pipe, prompts)
    assert deaf["relation_word"] == 0.0 and deaf["first_colour"] == moved["first_colour"]
