"""The guard's rules (diffrl/training/guard.py) on made-up evaluations: a gold reward that
falls while the trained one rises, monitors past their bounds, the best checkpoint chosen
among evaluations without an alarm, and the same state rebuilt on resume."""

from __future__ import annotations

import math

from diffrl.config import load_config
from diffrl.training.guard import Guard


def _cfg(*overrides):
    base = [
        "rewards=[{name: jpeg_compressibility}]",
        "eval.gold=[{name: shapeworld}]",
    ]
    return load_config("tiny_toy_flowgrpo", [*base, *overrides])


def _eval(trained, gold, gold_se=0.01, grid=0.0, drift=0.0):
    return {
        "eval/jpeg_compressibility/mean": trained,
        "eval/jpeg_compressibility/se": 0.01,
        "eval/gold/shapeworld/mean": gold,
        "eval/gold/shapeworld/se": gold_se,
        "eval/monitor/grid_energy/mean": grid,
        "eval/monitor/colour_drift": drift,
    }


def test_a_gold_drop_alarms_only_past_k_standard_errors_and_only_while_the_trained_reward_rises():
    guard = Guard(_cfg("guard.gold_drop_se=2.0"))
    assert guard.check(0, _eval(1.0, 0.50)).alarms == []
    # fell 0.02 with a change SE of sqrt(2) * 0.01 = 0.0141: 1.4 SE, no alarm
    assert guard.check(10, _eval(1.5, 0.48)).alarms == []
    metrics = _eval(1.5, 0.40)  # 7.1 SE
    verdict = guard.check(20, metrics)
    assert len(verdict.alarms) == 1 and "gold shapeworld fell 0.1" in verdict.alarms[0]
    assert math.isclose(metrics["eval/gold/shapeworld/change"], -0.10, rel_tol=1e-9)
    assert math.isclose(metrics["eval/gold/shapeworld/change_se"], math.hypot(0.01, 0.01))
    assert metrics["guard/alarms"] == 1
    assert guard.check(30, _eval(0.9, 0.30)).alarms == []  # the trained reward fell too: not hacking
    assert not verdict.stop


def test_monitor_bounds_the_best_checkpoint_and_stop():
    guard = Guard(_cfg("guard.limits={grid_energy: 0.1, colour_drift: 0.3}", "guard.stop=true"))
    assert guard.check(0, _eval(1.0, 0.50)).best  # the first evaluation is the best so far
    assert guard.check(10, _eval(1.2, 0.60, grid=0.05, drift=0.2)).best
    worse = guard.check(20, _eval(1.3, 0.55))
    assert not worse.best and not worse.alarms
    hacked = guard.check(30, _eval(2.0, 0.90, grid=0.3, drift=0.5))  # higher gold, but artefacts
    assert not hacked.best and hacked.stop and len(hacked.alarms) == 2
    assert guard.best == (10, 0.60)
    lines = guard.summary("RUN")
    assert lines[0].startswith("best:        RUN/checkpoints/best (step 10: eval/gold/shapeworld/mean 0.600")
    assert "monitor grid_energy moved +0.3" in lines[1]


def test_replay_rebuilds_the_state_from_the_logged_rows(tmp_path):
    rows = [{"step": s, **_eval(1.0 + s / 10, g)} for s, g in ((0, 0.5), (10, 0.7), (20, 0.4))]
    rows.insert(1, {"step": 5, "loss": 0.1})  # a training row without an evaluation
    live = Guard(_cfg("guard.gold_drop_se=2.0"))
    for row in rows:
        if "eval/gold/shapeworld/mean" in row:
            live.check(row["step"], dict(row))
    resumed = Guard(_cfg("guard.gold_drop_se=2.0"))
    resumed.replay(rows, tmp_path)
    assert resumed.best == live.best == (10, 0.7)
    assert resumed.alarms == live.alarms and len(live.alarms) == 1
