"""The weights a run evaluated are the weights it exports (issue 52, item 2): with an EMA
the checkpoint's diffusers LoRA holds the EMA weights and ``raw/`` the trained ones,
``meta.json`` says so, and the export loaded with ``pipe.load_lora_weights`` into a fresh
pipeline draws the evaluation's samples from the same noise."""

from __future__ import annotations

import json

import pytest
import torch

from diffrl.data.prompts import load_prompts
from diffrl.models import build_adapter
from diffrl.sampling.rollout import rollout_independent
from diffrl.sampling.settings import SamplerSettings
from diffrl.training.trainer import Trainer
from tests.helpers import load_script, quick_config

KEYS = [("export-test", i, 0) for i in range(2)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two iterations of the tiny toy with an EMA far from the trained weights (a reward
    that tells its random images apart, so the LoRA moves)."""
    out = tmp_path_factory.mktemp("export_run")
    sets = [
        "train.ema_decay=0.5",
        "checkpoint.every=1",
        "optim.lr=0.1",
        "rewards=[{name: jpeg_compressibility}]",
    ]
    cfg = quick_config("tiny_toy_flowgrpo", out, *sets)
    trainer = Trainer(cfg)
    trainer.fit()
    return trainer, out / "checkpoints" / "step-2"


def _images(adapter, prompts, cfg):
    steps = cfg.sampling.eval_num_steps or cfg.sampling.num_steps
    with torch.no_grad():
        cond = adapter.encode_prompts(prompts)
        traj = rollout_independent(
            adapter,
            adapter.transformer,
            cond,
            KEYS,
            SamplerSettings.of(cfg),
            num_steps=steps,
            kinds=["ode"] * steps,
        )
    return traj.images


def _fresh_with_lora(cfg, folder):
    adapter = build_adapter(cfg.model)
    adapter.pipe.load_lora_weights(str(folder))
    return adapter


def test_the_export_is_the_ema_and_draws_the_evaluation_s_samples(run):
    trainer, checkpoint = run
    cfg, prompts = trainer.cfg, load_prompts(trainer.cfg.data.eval_prompts)[:2]
    with trainer.ema.swapped_in():
        evaluated = _images(trainer.adapter, prompts, cfg)
    trained = _images(trainer.adapter, prompts, cfg)
    assert (evaluated - trained).abs().max() > 1e-2  # the EMA is not the trained weights
    exported = _images(_fresh_with_lora(cfg, checkpoint), prompts, cfg)
    torch.testing.assert_close(exported, evaluated, rtol=1e-4, atol=1e-5)
    raw = _images(_fresh_with_lora(cfg, checkpoint / "raw"), prompts, cfg)
    torch.testing.assert_close(raw, trained, rtol=1e-4, atol=1e-5)


def test_meta_and_the_closing_lines_say_which_weights_are_which(run, capsys):
    trainer, checkpoint = run
    weights = json.loads((checkpoint / "meta.json").read_text())["weights"]
    assert (
        weights["evaluated"] == "EMA"
        and weights["export"] == "EMA (decay 0.5; 2 updates in 2 optimizer steps)"
    )
    assert (
        weights["raw/"] == "trained"
        and "raw/pytorch_lora_weights.safetensors"
        in json.loads((checkpoint / "meta.json").read_text())["files"]
    )
    from diffrl.training.console import closing_lines

    assert "the evaluations scored the EMA weights (train.ema_decay 0.5)" in closing_lines(
        checkpoint, checkpoint, 0.5
    )


def test_the_export_command_writes_a_lora_folder_and_a_merged_transformer(run, tmp_path):
    trainer, checkpoint = run
    export = load_script("export")
    cfg, prompts = trainer.cfg, load_prompts(trainer.cfg.data.eval_prompts)[:2]
    lora = export.export(checkpoint, tmp_path / "lora")
    assert json.loads((lora / "export.json").read_text())["holds"].startswith("EMA")
    expected = _images(_fresh_with_lora(cfg, checkpoint), prompts, cfg)
    torch.testing.assert_close(_images(_fresh_with_lora(cfg, lora), prompts, cfg), expected)
    merged = export.export(checkpoint, tmp_path / "merged", merge=True)
    adapter = build_adapter(cfg.model)
    transformer = type(adapter.transformer).from_pretrained(merged / "transformer")
    adapter.pipe.transformer = transformer
    torch.testing.assert_close(_images(adapter, prompts, cfg), expected, rtol=1e-4, atol=1e-4)
    raw = export.export(checkpoint, tmp_path / "raw", weights="raw")
    assert json.loads((raw / "export.json").read_text())["holds"] == "trained"


def test_without_an_ema_the_export_is_the_trained_weights(tmp_path):
    cfg = quick_config(
        "tiny_toy_flowgrpo", tmp_path, "train.ema_decay=0", "train.max_steps=1", "checkpoint.every=1"
    )
    Trainer(cfg).fit()
    checkpoint = tmp_path / "checkpoints" / "step-1"
    assert json.loads((checkpoint / "meta.json").read_text())["weights"]["export"] == "trained"
    assert not (checkpoint / "raw").exists()


def test_checkpoints_and_exports_are_readable_as_the_umask_allows(run, tmp_path):
    """Issue 62, item 11: safetensors writes 0600 and copy2 kept it, so colleagues on a
    shared disk could not read a checkpoint or an export; and a run directory exports its
    newest checkpoint."""
    import os
    import stat

    _, checkpoint = run
    umask = os.umask(0)
    os.umask(umask)
    wanted = 0o666 & ~umask
    files = [p for p in checkpoint.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {wanted}
    export = load_script("export")
    out = export.export(checkpoint.parent.parent, tmp_path / "from_run_dir")  # the run directory
    assert json.loads((out / "export.json").read_text())["checkpoint"] == str(checkpoint)
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()} == {wanted}
