"""The few-step toy's distillation (diffrl/toy/reflow.py) on a tiny random teacher: the
pairs are the teacher's own Euler samples from their noise, the loss is flow matching on
the pair's straight line, and the script saves a model the toy family loads."""

from __future__ import annotations

import json

import torch

from diffrl.models import tiny
from diffrl.models.toy import ToyPipeline, build_components
from diffrl.toy.recipe import SigmaDensity
from diffrl.toy.reflow import ReflowConfig, few_step_scores, reflow, reflow_loss, teacher_pairs


def _teacher(tmp_path):
    with tiny.seeded(0):
        comps = build_components(resolution=32, layers=1, heads=2, text_hidden=32, text_layers=1)
    pipe = ToyPipeline(**comps, prediction="x0")
    pipe.save_pretrained(tmp_path / "teacher")
    return pipe


def test_pairs_are_the_teacher_s_own_samples_from_their_keyed_noise(tmp_path):
    teacher = _teacher(tmp_path)
    z, x0, captions = teacher_pairs(teacher, 6, steps=3, seed=5, batch=4)
    assert z.shape == x0.shape == (6, 3, 32, 32) and len(captions) == 6
    again = teacher(captions[4:], num_inference_steps=3, latents=z[4:], output_type="pt") * 2 - 1
    torch.testing.assert_close(x0[4:], again)
    z2, _, captions2 = teacher_pairs(teacher, 6, steps=3, seed=5, batch=4)
    assert torch.equal(z, z2) and captions == captions2  # keyed: the same pairs again


def test_the_loss_is_flow_matching_on_the_pair_s_straight_line(tmp_path):
    teacher = _teacher(tmp_path)
    z, x0, captions = teacher_pairs(teacher, 4, steps=2, seed=0)
    density = SigmaDensity((0.0,))
    loss = reflow_loss(teacher, z, x0, captions, torch.Generator().manual_seed(3), density)
    sigma = density.sample(4, torch.Generator().manual_seed(3)).view(-1, 1, 1, 1)
    embeds, pooled = teacher.text_embeddings(captions)
    x_t = (1 - sigma) * x0 + sigma * z
    want = ((teacher.velocity(x_t, sigma.flatten(), embeds, pooled) - (z - x0)) ** 2).mean()
    torch.testing.assert_close(loss, want)


def test_the_script_saves_a_model_that_loads_and_samples_in_few_steps(tmp_path):
    _teacher(tmp_path)
    cfg = ReflowConfig(
        teacher=str(tmp_path / "teacher"),
        out=str(tmp_path / "fewstep"),
        pairs=8,
        teacher_steps=2,
        steps=2,
        batch_size=4,
        warmup=1,
        eval_every=2,
        eval_prompts=2,
        eval_steps="2",
    )
    summary = reflow(cfg, log=lambda _: None)
    assert [row["step"] for row in summary["history"]] == [0, 2]
    assert json.loads((tmp_path / "fewstep" / "reflow_log.json").read_text())["config"]["pairs"] == 8
    student = ToyPipeline.from_pretrained(tmp_path / "fewstep")
    scores = few_step_scores(student, ["a red circle", "two blue squares"], 2, "consistency")
    assert set(scores) == {"strict", "partial"} and 0 <= scores["partial"] <= 1
