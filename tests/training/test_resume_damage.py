"""--resume on damaged checkpoints and metrics (issue 22, item 2): fall back to the newest
complete checkpoint and say why; one error for a checkpoint of a different model."""

import json
import shutil

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.inference.checkpoints import CheckpointError, checkpoint_problem, safetensors_problem
from diffrl.training.trainer import Trainer

QUICK = ["eval.every=0", "checkpoint.every=1", "checkpoint.keep=0", "logging.progress_bar=false"]


def _cfg(run, steps, *extra):
    return load_config(
        "tiny_flux_flowgrpo", [f"output_dir={run}", f"train.max_steps={steps}", *QUICK, *extra]
    )


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    run = tmp_path_factory.mktemp("resume") / "run"
    Trainer(_cfg(run, 3)).fit()
    return run


def _copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _truncate(f):
    f.write_bytes(f.read_bytes()[:-100])


DAMAGE = {
    "no meta.json": (lambda c: (c / "meta.json").unlink(), "no meta.json"),
    "bad meta.json": (lambda c: (c / "meta.json").write_text('{"step": '), "meta.json is damaged"),
    "truncated weights": (lambda c: _truncate(c / "trainable.safetensors"), "trainable.safetensors has"),
    "no optimizer": (lambda c: (c / "optimizer.bin").unlink(), "optimizer.bin is missing"),
    # not a safetensors file: only the sizes meta.json recorded at save time can tell
    "truncated optimizer": (lambda c: _truncate(c / "optimizer.bin"), "optimizer.bin has"),
    "empty directory": (lambda c: [f.unlink() for f in c.iterdir()], "the directory is empty"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_resume_latest_skips_a_damaged_checkpoint_says_why_and_continues(three_steps, tmp_path, capsys, kind):
    run = _copy(three_steps, tmp_path)
    damage, reason = DAMAGE[kind]
    damage(run / "checkpoints" / "step-3")
    trainer = Trainer(_cfg(run, 4))
    trainer.resume("latest")
    out = capsys.readouterr().out
    assert trainer.step == 2
    assert f"skips {run / 'checkpoints' / 'step-3'}: {reason}" in out
    trainer.fit()
    assert trainer.step == 4


def test_an_explicit_damaged_checkpoint_is_one_error(three_steps, tmp_path):
    run = _copy(three_steps, tmp_path)
    (run / "checkpoints" / "step-2" / "optimizer.bin").unlink()
    with pytest.raises(CheckpointError, match="optimizer.bin is missing"):
        Trainer(_cfg(run, 4)).resume(str(run / "checkpoints" / "step-2"))


def test_no_complete_checkpoint_left_offers_overwrite(three_steps, tmp_path):
    run = _copy(three_steps, tmp_path)
    for step in (1, 2, 3):
        (run / "checkpoints" / f"step-{step}" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint.*--overwrite"):
        Trainer(_cfg(run, 4)).resume("latest")


def test_a_torn_last_metrics_line_is_left_out_on_resume(three_steps, tmp_path, capsys):
    run = _copy(three_steps, tmp_path)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 4, "wall_ti')
    trainer = Trainer(_cfg(run, 4))
    trainer.resume("latest")
    trainer.fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "left out its torn last line" in capsys.readouterr().out


def test_a_different_lora_rank_is_one_error_naming_the_difference(three_steps, tmp_path, capsys):
    run = _copy(three_steps, tmp_path)
    rank = load_config("tiny_flux_flowgrpo").model.lora.rank
    with pytest.raises(CheckpointError, match=f"model.lora.rank is {rank} there and {rank * 2} here"):
        Trainer(_cfg(run, 4, f"model.lora.rank={rank * 2}")).resume("latest")
    code = main(
        [
            "--config",
            "tiny_flux_flowgrpo",
            "--resume",
            "latest",
            "--set",
            f"output_dir={run}",
            "--set",
            f"model.lora.rank={rank * 2}",
            "--set",
            "train.max_steps=4",
            "--set",
            "logging.progress_bar=false",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "different model" in err


def test_the_safetensors_check_agrees_with_the_library(tmp_path):
    f = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(3, 4), "b": torch.randn(5)}, str(f))
    assert safetensors_problem(f) is None and checkpoint_problem(tmp_path) is not None
    whole = f.read_bytes()
    for cut in (4, 20, len(whole) - 1):
        f.write_bytes(whole[:cut])
        assert safetensors_problem(f) is not None
        with pytest.raises(SafetensorError):
            load_file(str(f))


def test_resuming_with_another_ema_setting_names_the_setting(three_steps, tmp_path):
    """Issue 62, item 1 for resume: the run kept no EMA and this config keeps one, so the
    checkpoint holds other registered objects than the resume registers; the one error
    names the setting, not only accelerate's 'Number of custom checkpoints'."""
    run = _copy(three_steps, tmp_path)
    with pytest.raises(CheckpointError, match=r"train\.ema_decay is 0\.0 there and 0\.9 here: resume with"):
        Trainer(_cfg(run, 4, "train.ema_decay=0.9")).resume("latest")
