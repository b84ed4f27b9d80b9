"""tools/objective_table.py: seed spreads, ratios to the base and the equal-wall-time
reading, on synthetic runs whose answers are known by hand."""

import json

from tests.helpers import load_script


def _run(path, points):
    """points: (step, minutes, strict)."""
    path.mkdir(parents=True)
    rows = [{"step": s, "time/update": 10.0, "time/rollout": 2.0, "time/reward": 1.0} for s in range(1, 5)]
    for step, minutes, strict in points:
        rows.append(
            {
                "step": step,
                "wall_time": 60.0 * minutes,
                "eval/shapeworld_strict/mean": strict,
                "eval/shapeworld_strict/se": 0.02,
                "eval_train/shapeworld_strict/mean": strict,
                "eval/shapeworld_partial/mean": 0.7,
                "eval/fidelity/background_darkness/mean": 0.004,
                "eval/diversity": 0.2,
            }
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_table_rows_and_equal_wall_time(tmp_path, capsys):
    _run(tmp_path / "awm-s0", [(2, 1.0, 0.5), (4, 2.0, 0.6)])
    _run(tmp_path / "awm-s1", [(2, 1.0, 0.3), (4, 2.0, 0.4)])
    _run(tmp_path / "nft-s0", [(2, 2.0, 0.45), (4, 4.0, 0.5)])
    args = [str(tmp_path), "--base-strict", "0.4", "--base-darkness", "0.002", "--base-diversity", "0.1"]
    load_script("objective_table").main(args)
    out = capsys.readouterr().out
    assert (
        "| awm | 4 | 2.0 | 0.500 ± 0.141 [0.400, 0.600] | 0.020 | 0.500 | 0.700 | 2.00x | 2.00x | 13.0 |"
        in out
    )
    # budget = the shortest last evaluation, 2 minutes: awm at its own points, nft halfway 0.4 -> 0.45
    assert "awm: 0.500 ± 0.141" in out and "nft: 0.450 ± 0.000" in out
