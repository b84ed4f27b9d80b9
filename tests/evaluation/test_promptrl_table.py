"""tools/promptrl_table.py: the PromptRL comparison's cells from run directories."""

from __future__ import annotations

import json

from tests.helpers import load_script


def _run(folder, rewards, first, last):
    folder.mkdir(parents=True)
    rows = [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]
    rows[0].update(first)
    rows[-1].update(last)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_cells_are_mean_and_sd_over_seeds_and_rollouts_to_target_use_a_running_mean(tmp_path, capsys):
    table = load_script("promptrl_table")
    key, se = "eval/shapeworld_strict/mean", "eval/shapeworld_strict/se"
    _run(tmp_path / "flow_only-s0", [0.5] * 4 + [0.9] * 6, {"eval/n": 656, key: 0.3, se: 0.02},
         {"eval/n": 656, key: 0.8, se: 0.01})  # fmt: skip
    _run(tmp_path / "flow_only-s1", [0.5] * 10, {"eval/n": 656, key: 0.4, se: 0.04},
         {"eval/n": 656, key: 0.9, se: 0.03})  # fmt: skip
    assert table.rollouts_to(table.rows_of(tmp_path / "flow_only-s0" / "metrics.jsonl"), 0.85) == 9 * 256
    assert table.rollouts_to(table.rows_of(tmp_path / "flow_only-s1" / "metrics.jsonl"), 0.85) is None
    table.main([str(tmp_path), "--seeds", "0", "1", "--arms", "flow_only", "--target", "0.85"])
    out = capsys.readouterr().out
    assert "| held-out strict | 0.350 ± 0.071 (eval SE 0.030) | 0.850 ± 0.071 (eval SE 0.020) |" in out
    assert "[2304, None]" in out


def test_rollouts_to_an_evaluation_target_are_the_first_evaluation_reaching_it():
    table = load_script("promptrl_table")
    evals = [{"step": 0, "k": 0.1}, {"step": 50, "k": 0.5}, {"step": 100, "k": 0.9}]
    assert table.evaluations_to(evals, "k", 0.5) == 50 * 256
    assert table.evaluations_to(evals, "k", 0.95) is None
