"""Methods over seeds (diffrl.evaluation.seed_groups, report.py NAME=DIR1,DIR2): spreads against
numpy, only evaluation steps every seed reached, fidelity as each run's ratio to its own
start, and the report's methods table and plot."""

import json

import numpy as np
import pytest
from PIL import Image

from diffrl.evaluation.seed_groups import DARKNESS, HELDOUT, common_steps, curve, methods_table
from tests.helpers import load_script


def _rows(strict, darkness, steps=(0, 10, 20), minutes=1.0):
    return [
        {
            "step": s,
            "wall_time": 60.0 * minutes * s,
            HELDOUT: a,
            "eval/shapeworld_strict/se": 0.02,
            DARKNESS: d,
            "eval/diversity": 0.2,
            "eval_train/shapeworld_strict/mean": a + 0.01,
        }
        for s, a, d in zip(steps, strict, darkness)
    ]


def test_curve_is_the_mean_and_sample_sd_over_seeds_at_common_steps():
    group = [
        _rows([0.3, 0.4, 0.5], [1.0, 2.0, 3.0]),
        _rows([0.3, 0.5, 0.6], [2.0, 2.0, 2.0]),
        _rows([0.3, 0.45], [1.0, 1.5], steps=(0, 10)),
    ]  # the third seed stopped at 10
    assert common_steps(group) == [0, 10]
    points = curve(group, HELDOUT)
    assert [step for step, _ in points] == [0, 10]
    at10 = points[1][1]
    want = np.array([0.4, 0.5, 0.45])
    assert at10.mean == pytest.approx(want.mean()) and at10.sd == pytest.approx(want.std(ddof=1))
    assert (at10.lo, at10.hi, at10.n) == (0.4, 0.5, 3)
    ratio = curve(group, DARKNESS, ratio_to_start=True)[1][1]
    assert ratio.mean == pytest.approx(np.mean([2.0 / 1.0, 2.0 / 2.0, 1.5 / 1.0]))


def test_no_ratio_to_the_base_without_a_step_0_evaluation():
    """Runs evaluated first at step 10 have no base to divide by: no ratio points (and
    '-' in the methods table) rather than a ratio to a trained model read as one to the base."""
    group = [_rows([0.4, 0.5], [2.0, 3.0], steps=(10, 20))]
    assert curve(group, DARKNESS, ratio_to_start=True) == []
    assert len(curve(group, DARKNESS)) == 2
    assert "| late | 1 | 10 | 10.0 | - | 0.400 | 0.020 | 0.410 | - | - |" in methods_table({"late": group})


def test_report_groups_seeds_into_one_methods_table_and_plot(tmp_path):
    runs = {
        "a0": _rows([0.3, 0.4, 0.5], [1.0, 1.0, 1.1]),
        "a1": _rows([0.3, 0.42, 0.54], [1.0, 1.0, 1.0]),
        "b0": _rows([0.3, 0.35, 0.36], [1.0, 3.0, 4.5]),
    }
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = load_script("report").main(
        [
            f"anchor={tmp_path / 'a0'},{tmp_path / 'a1'}",
            f"plain={tmp_path / 'b0'}",
            "--out",
            str(tmp_path / "rep"),
        ]
    )
    table = (out / "summary.md").read_text()
    anchor = "| anchor | 2 | 20 | 20.0 | - | 0.520 ± 0.028 [0.500, 0.540] | 0.020 | 0.530 | 1.05x | 1.00x |"
    assert anchor in table
    assert "| plain | 1 | 20 | 20.0 | - | 0.360 | 0.020 | 0.370 | 4.50x | 1.00x |" in table
    assert "| anchor/a0 |" in table  # each seed also keeps its own row in the run summary
    assert Image.open(out / "report.png").size[0] > 0
    assert methods_table({"x": [runs["a0"]]}).count("| x | 1 |") == 3


@pytest.mark.parametrize(
    "specs, message", [(["plain="], "names no run directory"), (["x=A", "x=A"], "two runs are named 'x'")]
)
def test_report_rejects_empty_and_repeated_method_names(tmp_path, specs, message):
    (tmp_path / "A").mkdir()
    (tmp_path / "A" / "metrics.jsonl").write_text(json.dumps(_rows([0.3], [1.0], steps=(0,))[0]) + "\n")
    script = load_script("report")
    specs = [s.replace("=A", f"={tmp_path / 'A'}") for s in specs]
    with pytest.raises(script.ReportError, match=message):
        script.main([*specs, "--out", str(tmp_path / "rep")])


def test_video_runs_report_their_own_strict_accuracy():
    """Runs that log no image strict accuracy are summarised by the one they log
    (the video world's shapeworld_video_strict), held-out and training alike."""
    video = "eval/shapeworld_video_strict/mean"
    rows = [
        {
            "step": s,
            "wall_time": 60.0 * s,
            video: a,
            "eval/shapeworld_video_strict/se": 0.03,
            "eval_train/shapeworld_video_strict/mean": a + 0.1,
            "eval/shapeworld_video_moves/mean": 0.9,
        }
        for s, a in ((0, 0.2), (10, 0.5))
    ]
    table = methods_table({"rl": [rows, rows]})
    assert "| rl | 2 | 10 | 10.0 | - | 0.500 ± 0.000 [0.500, 0.500] | 0.030 | 0.600 | - | - |" in table


def test_nfe_axis_is_the_rollout_nfe_spent_so_far_averaged_over_seeds():
    """Methods that spend different NFE per iteration (a tree, a pool, independent
    rollouts) line up on the NFE axis: each run's x is the sum of its own rollout/nfe up to
    the evaluation, and the table shows the seed mean."""
    cheap = [dict(row, **{"rollout/nfe": 100.0}) for row in _rows([0.3, 0.4, 0.5], [1.0, 1.0, 1.0])]
    costly = [dict(row, **{"rollout/nfe": 300.0}) for row in _rows([0.3, 0.4, 0.5], [1.0, 1.0, 1.0])]
    for rows in (cheap, costly):  # an evaluation-only row at step 0 spends nothing
        rows[0].pop("rollout/nfe")
        nfe = rows[1]["rollout/nfe"]
        rows[1:1] = [{"step": s, "wall_time": 0.0, "rollout/nfe": nfe} for s in range(1, 10)]
    xs = [x for x, _ in curve([cheap, costly], HELDOUT, x="nfe")]
    assert xs == [0.0, (1000 + 3000) / 2, (1100 + 3300) / 2]  # steps 10 and 20: 10 and 11 iterations
    assert "| both | 2 | 10 | 10.0 | 2,000 | 0.400" in methods_table({"both": [cheap, costly]})


def test_a_base_evaluation_gives_runs_started_without_one_their_step_0(tmp_path):
    """Comparison runs skip the step-0 evaluation (every method shares the base); --base-eval
    supplies it from scripts/evaluate.py --json, so darkness and diversity read as ratios to
    the base instead of '-', and the seed means alone are drawn in methods.png."""
    for name, darkness in (("s0", 2.0), ("s1", 4.0)):
        rows = _rows([0.4, 0.5], [darkness, darkness], steps=(10, 20))
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = {"checkpoint": "base", HELDOUT: 0.3, DARKNESS: 1.0, "eval/diversity": 0.1}
    (tmp_path / "base.json").write_text(json.dumps(base))
    out = load_script("report").main(
        [
            f"tree={tmp_path / 's0'},{tmp_path / 's1'}",
            "--base-eval",
            str(tmp_path / "base.json"),
            "--out",
            str(tmp_path / "r"),
        ]
    )
    table = (out / "summary.md").read_text()
    assert "| tree | 2 | 0 | 0.0 | - | 0.300 ± 0.000 [0.300, 0.300] |" in table
    assert "| 3.00x | 2.00x |" in table  # darkness (2 + 4) / 2 over the base's 1; diversity 0.2 / 0.1
    assert Image.open(out / "methods.png").size[0] > 0
    with pytest.raises(Exception, match="--base-eval"):
        load_script("report").main([f"tree={tmp_path / 's0'}", "--base-eval", str(tmp_path / "nope.json")])
