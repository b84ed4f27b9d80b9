"""tools/precision_table.py on made-up runs: the mean and sd over seeds, the mean
standard error, the replay gap and clip fraction over training rows; unfinished runs
are left out."""

import json

from tests.helpers import load_script


def _run(path, strict_25, strict_50, gap):
    rows = []
    for step in range(1, 51):
        row = {
            "step": step,
            "wall_time": 2.0 * step,
            "clipfrac": 0.1,
            "rollout/nfe": 2560,
            "replay/logprob_gap": gap,
        }
        if step in (25, 50):
            row.update(
                {
                    "eval/shapeworld_strict/mean": strict_25 if step == 25 else strict_50,
                    "eval/shapeworld_strict/se": 0.02,
                    **{
                        f"eval/fidelity/{k}/mean": 0.0
                        for k in ("background_darkness", "off_palette", "stray_pixels")
                    },
                }
            )
        rows.append(row)
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def test_table(tmp_path, capsys):
    _run(tmp_path / "bf16-s0", 0.6, 0.8, 0.0)
    _run(tmp_path / "bf16-s1", 0.7, 0.9, 0.0)
    _run(tmp_path / "naive-s0", 0.5, 0.7, 2e-5)
    (tmp_path / "naive-s1").mkdir()  # still running: first row only
    (tmp_path / "naive-s1" / "metrics.jsonl").write_text(json.dumps({"step": 1, "clipfrac": 0.5}))
    load_script("precision_table").main([str(tmp_path), "bf16", "naive"])
    lines = capsys.readouterr().out.splitlines()
    assert "iteration 25 | held-out strict, iteration 50" in lines[0]
    bf16, naive = lines[2], lines[3]
    # mean 0.65, sd of (0.6, 0.7) = 0.0707
    assert bf16.startswith("| bf16 | 2 | 0.650 ± 0.071 (se 0.020) | 0.850 ± 0.071 (se 0.020) |")
    assert naive.startswith("| naive | 1 | 0.500 ± 0.000") and "| 2.0e-05 | 0.100 | 2560 | 2.0 |" in naive
