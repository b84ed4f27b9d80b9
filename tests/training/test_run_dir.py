"""A new run never mixes with an earlier one in the same output_dir (issue 22, item 1)."""

import json

import pytest

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.training.run_dir import RunDirInUseError
from diffrl.training.trainer import Trainer

QUICK = ["train.max_steps=2", "eval.every=0", "checkpoint.every=1", "logging.progress_bar=false"]


def _cli(run_dir, *extra):
    args = ["--config", "tiny_flux_flowgrpo", "--set", f"output_dir={run_dir}"]
    for o in QUICK:
        args += ["--set", o]
    return main(args + list(extra))


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_second_fresh_run_is_refused_with_one_line_and_touches_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli(run) == 0
    before = {p.relative_to(run): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert _cli(run) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: output_dir '{run}' already holds a run")
    for way in ("--resume latest", "--set output_dir=", "--overwrite"):
        assert way in err
    after = {p.relative_to(run): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    assert after == before


def test_overwrite_replaces_only_the_earlier_runs_files(tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli(run, "--set", "train.max_steps=3") == 0
    (run / "my_notes.txt").write_text("keep me")
    assert _cli(run, "--overwrite") == 0
    assert "--overwrite: deleted metrics.jsonl, config.yaml, checkpoints/" in capsys.readouterr().out
    assert _steps(run) == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert (run / "my_notes.txt").read_text() == "keep me"


def test_resume_is_still_allowed_and_overwrite_with_resume_is_one_error(tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli(run) == 0
    assert _cli(run, "--resume", "latest", "--set", "train.max_steps=3") == 0
    assert _steps(run) == [1, 2, 3]
    capsys.readouterr()
    assert _cli(run, "--resume", "latest", "--overwrite") == 2
    assert "pass one of them" in capsys.readouterr().err


def test_the_trainer_itself_refuses_a_used_directory(tmp_path):
    cfg = load_config("tiny_flux_flowgrpo", [f"output_dir={tmp_path / 'run'}", *QUICK])
    Trainer(cfg).fit()
    with pytest.raises(RunDirInUseError, match="already holds a run"):
        Trainer(cfg).fit()


def test_ctrl_c_stops_without_a_traceback_and_names_the_checkpoint_to_resume(tmp_path, capsys, monkeypatch):
    real = Trainer.train_step

    def pressed_at_the_third(self, step):
        if step == 2:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(Trainer, "train_step", pressed_at_the_third)
    run = tmp_path / "run"
    assert _cli(run, "--set", "train.max_steps=4") == 130
    err = capsys.readouterr().err.strip()
    assert err == (
        f"interrupted: the last checkpoint is {run / 'checkpoints' / 'step-2'} (after iteration 2); "
        "continue with --resume latest and the same --config and --set"
    )
    monkeypatch.setattr(Trainer, "train_step", real)
    assert _cli(run, "--set", "train.max_steps=4", "--resume", "latest") == 0
    assert _steps(run) == [1, 2, 3, 4]


def test_tensorboard_is_on_by_default_and_a_missing_tracker_stops_the_start(tmp_path):
    from diffrl.config import ConfigError
    from diffrl.training.tracking import check_trackers

    run = tmp_path / "run"
    assert load_config("toy_flowgrpo").logging.trackers == ["tensorboard"]
    assert _cli(run) == 0
    assert list((run / "logs").rglob("events.out.tfevents.*")), "no TensorBoard event file"
    with pytest.raises(
        ConfigError, match="'no_such_tracker', which is not installed: pip install no_such_tracker"
    ):
        check_trackers(["tensorboard", "no_such_tracker"])


@pytest.mark.parametrize(
    "typo", [["--set", "rewards=[{name: hpsv9}]"], ["--set", "data.train_prompts=missing_prompts.txt"]]
)
def test_overwrite_with_a_typo_fails_before_it_deletes_the_earlier_run(tmp_path, capsys, typo):
    """A bad reward name or prompt file is one error, and --overwrite has not yet cleared
    the run it was about to replace (the check used to come after the clearing)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("run_name: earlier\n")
    assert _cli(run, "--overwrite", *typo) == 2
    assert "error:" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (run / "config.yaml").is_file()
