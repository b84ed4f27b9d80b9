#!/usr/bin/env python
"""The table of tools/compare_promptrl.sh (docs/BENCHMARKS.md, "PromptRL on ShapeWorld"):
per arm, held-out strict accuracy on the prompts and on their paraphrases, the gap,
diversity, at the first and the last evaluation (mean ± sd over seeds, and the mean of
the evaluations' own standard errors), and the rollouts each seed needed for its training
reward (a 5-iteration running mean) to first reach TARGET.

    python tools/promptrl_table.py OUT_DIR [--seeds 0 1 2] [--target 0.85]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROLLOUTS_PER_ITERATION = 256  # 16 prompts x 16 images, both arms
ROWS = [
    ("held-out strict", "eval/shapeworld_strict/mean", "eval/shapeworld_strict/se"),
    ("paraphrases strict", "eval_para/shapeworld_strict/mean", "eval_para/shapeworld_strict/se"),
    ("gap (original - paraphrase)", "eval_para/shapeworld_strict/gap", "eval_para/shapeworld_strict/gap_se"),
    (
        "held-out strict, flow model alone",
        "eval_plain/shapeworld_strict/mean",
        "eval_plain/shapeworld_strict/se",
    ),
    ("paraphrases strict, flow model alone", "eval_para_plain/shapeworld_strict/mean", None),
    ("diversity (held-out)", "eval/diversity", None),
    ("diversity (paraphrases)", "eval_para/diversity", None),
    ("off-palette (held-out)", "eval/fidelity/off_palette/mean", None),
]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cell(values: list[float], ses: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    se = f" (eval SE {statistics.mean(ses):.3f})" if ses else ""
    return f"{statistics.mean(values):.3f} ± {sd:.3f}{se}"


def rollouts_to(rows: list[dict], target: float, window: int = 5) -> int | None:
    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    for i in range(window, len(rewards) + 1):
        if statistics.mean(rewards[i - window : i]) >= target:
            return i * ROLLOUTS_PER_ITERATION
    return None


def evaluations_to(evals: list[dict], key: str, target: float) -> int | None:
    """Rollouts spent at the first evaluation where ``key`` reaches ``target`` (None: never)."""
    for row in evals:
        if row.get(key) is not None and row[key] >= target:
            return row["step"] * ROLLOUTS_PER_ITERATION
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seeds", nargs="+", default=["0", "1", "2"])
    p.add_argument("--arms", nargs="+", default=["flow_only", "promptrl"])
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--strict-target", type=float, default=0.8, help="held-out strict to reach")
    p.add_argument("--para-target", type=float, default=0.25, help="paraphrases' strict to reach")
    args = p.parse_args(argv)
    for arm in args.arms:
        runs = [rows_of(args.out / f"{arm}-s{s}" / "metrics.jsonl") for s in args.seeds]
        evals = [[r for r in run if "eval/n" in r] for run in runs]
        print(f"\n### {arm} ({len(runs)} seeds)\n")
        print("| measure | first evaluation | last evaluation |\n|---|---|---|")
        for label, key, se_key in ROWS:
            cells = []
            for pick in (0, -1):
                chosen = [e[pick] for e in evals if e and key in e[pick] and e[pick][key] is not None]
                values = [c[key] for c in chosen]
                ses = [c[se_key] for c in chosen if se_key and c.get(se_key) is not None]
                cells.append(cell(values, ses))
            if cells != ["-", "-"]:
                print(f"| {label} | {cells[0]} | {cells[1]} |")
        steps = sorted({e[-1]["step"] for e in evals if e})
        needed = [rollouts_to(run, args.target) for run in runs]
        print(f"\nlast evaluation at step {steps}; rollouts to a training reward of {args.target}: {needed}")
        for key, target in (("eval/shapeworld_strict/mean", args.strict_target),
                            ("eval_para/shapeworld_strict/mean", args.para_target)):  # fmt: skip
            reached = [evaluations_to(e, key, target) for e in evals]
            print(f"rollouts to {key} >= {target} (at an evaluation): {reached}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
