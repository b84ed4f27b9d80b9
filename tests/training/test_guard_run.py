"""The gold panel, the monitors and the guard in a tiny toy run (eval.gold, eval.monitors,
guard.*): their keys in metrics.jsonl, the best checkpoint kept and named at the close, a
stop that saves its checkpoint first, and the same guard after a resume."""

from __future__ import annotations

import json

from diffrl.evaluation.summary import read_metrics
from diffrl.training.guard import Verdict
from diffrl.training.trainer import Trainer
from tests.helpers import fit_until_killed, quick_config

GUARDED = [
    "rewards=[{name: jpeg_compressibility}]",
    "eval.gold=[{name: shapeworld}]",
    "eval.every=1",
    "eval.at_start=true",
    "eval.num_prompts=2",
    "train.max_steps=3",
    "guard.gold_drop_se=2.0",
]


def test_the_panel_and_monitors_are_logged_and_the_best_checkpoint_is_kept(tmp_path, capsys):
    run = tmp_path / "run"
    trainer = Trainer(quick_config("tiny_toy_flowgrpo", run, *GUARDED))
    trainer.fit()
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "eval/gold/shapeworld/mean" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval/monitor/colour_drift"] == 0.0 and rows[0]["eval/gold/shapeworld/change"] == 0.0
    for row in rows:
        assert {"eval/gold/shapeworld/se", "eval/monitor/grid_energy/mean", "guard/alarms"} <= set(row)
        assert "eval/monitor/spread_across_prompts" in row and "eval/jpeg_compressibility/mean" in row
    best_step, best_value = trainer.guard.best
    assert best_value == max(r["eval/gold/shapeworld/mean"] for r in rows if r["step"] <= best_step)
    kept = json.loads((run / "checkpoints" / "best" / "meta.json").read_text())
    assert kept["step"] == best_step
    assert f"best:        {run / 'checkpoints' / 'best'} (step {best_step}" in capsys.readouterr().out


def test_a_stop_saves_the_checkpoint_and_ends_the_run(tmp_path, monkeypatch):
    run = tmp_path / "run"
    trainer = Trainer(quick_config("tiny_toy_flowgrpo", run, *GUARDED, "guard.stop=true"))
    real = trainer.guard.check

    def alarm_at_step_2(step, metrics):
        verdict = real(step, metrics)
        return Verdict(["made-up alarm"], False, True) if step == 2 else verdict

    monkeypatch.setattr(trainer.guard, "check", alarm_at_step_2)
    trainer.fit()
    assert trainer.step == 2
    assert (run / "checkpoints" / "step-2" / "meta.json").is_file()
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl")) == 2


def test_a_resumed_run_keeps_its_guard(tmp_path):
    run = tmp_path / "run"
    keep = (*GUARDED, "checkpoint.every=1")
    whole = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path / "whole", *keep))
    whole.fit()
    first = Trainer(quick_config("tiny_toy_flowgrpo", run, *keep))
    fit_until_killed(first, at_step=2)
    resumed = Trainer(quick_config("tiny_toy_flowgrpo", run, *keep))
    resumed.resume("latest")
    resumed.fit()
    assert resumed.guard.best == whole.guard.best and resumed.guard.alarms == whole.guard.alarms
    assert resumed.guard.watch.keys() == whole.guard.watch.keys() == {"colour_histogram"}
    final = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] == 3][0]
    reference = [r for r in read_metrics(tmp_path / "whole" / "metrics.jsonl") if r["step"] == 3][0]
    assert final["eval/monitor/colour_drift"] == reference["eval/monitor/colour_drift"]
