"""The objectives table of docs/BENCHMARKS.md from tools/compare_objectives.sh's runs:
per method and evaluation, held-out strict over seeds (mean, sample sd, range), fidelity
and diversity as ratios to a base evaluation, the median seconds per iteration, and
held-out strict at equal wall time (each run linear from the base at 0 minutes through its
evaluations, read at the shortest run's last evaluation).

    python tools/objective_table.py OUT_DIR --base-strict 0.328 --base-darkness 0.000465 \
        --base-diversity 0.1835
"""

from __future__ import annotations

import argparse
import json
import statistics as st
from pathlib import Path

HELDOUT = "eval/shapeworld_strict/mean"
METHODS = ["flow_grpo", "nft", "grpo_guard", "flow_dppo", "awm", "dgpo"]


def _runs(out: Path, method: str) -> list[list[dict]]:
    files = sorted(out.glob(f"{method}-s*/metrics.jsonl"))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def _evals(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if HELDOUT in r}


def _row(method, step, runs, base) -> str:
    ev = [_evals(rows)[step] for rows in runs]
    a = [e[HELDOUT] for e in ev]
    sd = st.stdev(a) if len(a) > 1 else 0.0

    def mean(key):
        return st.fmean(e[key] for e in ev)

    dark = mean("eval/fidelity/background_darkness/mean") / base.base_darkness
    div = mean("eval/diversity") / base.base_diversity
    per_iteration = st.fmean(
        st.median(r["time/update"] + r["time/rollout"] + r["time/reward"] for r in rows if "time/update" in r)
        for rows in runs
    )
    return (
        f"| {method} | {step} | {mean('wall_time') / 60:.1f} | {st.fmean(a):.3f} ± {sd:.3f} "
        f"[{min(a):.3f}, {max(a):.3f}] | {mean(HELDOUT.replace('/mean', '/se')):.3f} | "
        f"{mean('eval_train/shapeworld_strict/mean'):.3f} | {mean('eval/shapeworld_partial/mean'):.3f} | "
        f"{dark:.2f}x | {div:.2f}x | {per_iteration:.1f} |"
    )


def _at(rows: list[dict], minutes: float, base_strict: float) -> float:
    points = [(0.0, base_strict)] + [(e["wall_time"] / 60, e[HELDOUT]) for e in _evals(rows).values()]
    for (t0, a0), (t1, a1) in zip(points, points[1:]):
        if t0 <= minutes <= t1:
            return a0 + (a1 - a0) * (minutes - t0) / (t1 - t0)
    raise ValueError(f"no evaluation brackets {minutes:.1f} minutes")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--base-strict", type=float, required=True)
    ap.add_argument("--base-darkness", type=float, required=True)
    ap.add_argument("--base-diversity", type=float, required=True)
    args = ap.parse_args(argv)
    groups = {m: runs for m in METHODS if (runs := _runs(args.out, m))}
    print(
        "| objective | iteration | minutes | held-out strict (mean ± sd [min, max]) | eval SE | "
        "training strict | partial | darkness x base | diversity x base | s per iteration (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for method, runs in groups.items():
        steps = sorted(set.intersection(*[set(_evals(rows)) for rows in runs]))
        for step in steps:
            print(_row(method, step, runs, args))
    ends = [
        max(_evals(rows).values(), key=lambda e: e["step"])["wall_time"] / 60
        for g in groups.values()
        for rows in g
    ]
    budget = min(ends)
    print(f"\nheld-out strict at equal wall time, {budget:.1f} minutes:")
    for method, runs in groups.items():
        values = [_at(rows, budget, args.base_strict) for rows in runs]
        sd = st.stdev(values) if len(values) > 1 else 0.0
        print(f"  {method}: {st.fmean(values):.3f} ± {sd:.3f}")


if __name__ == "__main__":
    main()
