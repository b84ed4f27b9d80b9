#!/usr/bin/env python
"""The table of tools/compare_precision.sh's runs (docs/BENCHMARKS.md, "FP8 rollouts"):
per arm, held-out strict at each evaluation (mean ± sd over seeds, and the evaluations'
mean standard error), the background fidelity measures at the end, the replay log-prob
gap (training forward against sampling, before each iteration's first step), the clip
fraction, the rollout NFE per iteration and the seconds per iteration.

    python tools/precision_table.py OUT_DIR [ARM ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

STRICT = "eval/shapeworld_strict"
FIDELITY = ("background_darkness", "off_palette", "stray_pixels")


def runs(out: Path, arm: str) -> list[list[dict]]:
    dirs = sorted(out.glob(f"{arm}-s*/metrics.jsonl"))
    return [[json.loads(line) for line in d.read_text().splitlines()] for d in dirs]


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def evaluations(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if f"{STRICT}/mean" in r}


def arm_row(arm: str, seeds: list[list[dict]], steps: list[int]) -> str:
    evals = [evaluations(rows) for rows in seeds]
    cells = []
    for step in steps:
        strict = [e[step][f"{STRICT}/mean"] for e in evals]
        se = statistics.mean(e[step][f"{STRICT}/se"] for e in evals)
        cells.append(f"{spread(strict)} (se {se:.3f})")
    last = [e[steps[-1]] for e in evals]
    fidelity = " / ".join(
        f"{statistics.mean(r[f'eval/fidelity/{k}/mean'] for r in last):.3f}" for k in FIDELITY
    )
    train = [r for rows in seeds for r in rows if "clipfrac" in r]
    gap = statistics.mean(r.get("replay/logprob_gap", 0.0) for r in train)
    clip = statistics.mean(r["clipfrac"] for r in train)
    nfe = statistics.mean(r["rollout/nfe"] for r in train)
    seconds = statistics.mean(rows[-1]["wall_time"] / rows[-1]["step"] for rows in seeds)
    return (
        f"| {arm} | {len(seeds)} | "
        + " | ".join(cells)
        + f" | {fidelity} | {gap:.1e} | {clip:.3f} | {nfe:.0f} | {seconds:.1f} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("arms", nargs="*", default=["bf16", "naive", "unified", "solrl"])
    a = ap.parse_args(argv)
    # finished runs only: every evaluation of the longest run present
    every = [evaluations(rows) for arm in a.arms for rows in runs(a.out, arm)]
    steps = sorted(max(every, key=len)) if every else []
    found = {arm: [r for r in runs(a.out, arm) if set(steps) <= set(evaluations(r))] for arm in a.arms}
    found = {arm: seeds for arm, seeds in found.items() if seeds}
    if not found:
        raise SystemExit(f"no finished runs under {a.out} (expected ARM-sSEED/metrics.jsonl)")
    head = " | ".join(f"held-out strict, iteration {s}" for s in steps)
    print(
        f"| arm | seeds | {head} | darkness / off-palette / stray at the end | replay log-prob gap | "
        "clip fraction | rollout NFE / iteration | s / iteration |"
    )
    print("|" + "---|" * (7 + len(steps)))
    for arm, seeds in found.items():
        print(arm_row(arm, seeds, steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
