#!/usr/bin/env python
"""The table and curves of the guard's demonstration (configs/toy_guard_hack.yaml;
docs/BENCHMARKS.md, "Reward hacking caught on ShapeWorld"): per seed, where the verifier
(the gold panel) peaked, the first alarm and its rule, and the proxy, the verifier, the
colour drift and the diversity at the start, at the kept checkpoint and at the last one;
then their mean ± sd over seeds. With ``--plot`` it also draws the proxy and the verifier
against the iteration (mean ± sd over seeds), with the alarms marked.

    python tools/guard_table.py RUNS_DIR [--seeds 0 1 2] [--plot FILE.png]

RUNS_DIR holds one run per seed, ``seed<N>/`` (each run's own metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PROXY = "eval/shapeworld_colour_coverage/mean"
GOLD = "eval/gold/shapeworld/mean"
GOLD_SE = "eval/gold/shapeworld/se"
COLUMNS = [("proxy", PROXY), ("verifier strict", GOLD), ("colour drift", "eval/monitor/colour_drift"),
           ("diversity", "eval/diversity")]  # fmt: skip


def evaluations(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if GOLD in r]


def first_alarm(run: Path) -> tuple[int, str] | None:
    """(step, message) of the run's first `guard:` line."""
    for line in (run.parent / f"{run.name}.log").read_text().splitlines():
        if line.startswith("guard: step "):
            step, _, message = line.removeprefix("guard: step ").partition(": ")
            return int(step), message
    return None


def kept_step(run: Path) -> int:
    return json.loads((run / "checkpoints" / "best" / "meta.json").read_text())["step"]


def seed_row(run: Path) -> dict:
    evals = evaluations(run)
    by_step = {r["step"]: r for r in evals}
    kept = kept_step(run)
    alarm = first_alarm(run)
    row = {"kept_step": kept, "alarm": alarm}
    for when, step in (("start", evals[0]["step"]), ("kept", kept), ("last", evals[-1]["step"])):
        row[when] = {name: by_step[step][key] for name, key in COLUMNS}
        row[when]["se"] = by_step[step][GOLD_SE]
    return row


def mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def table(rows: dict[int, dict]) -> str:
    header = "| seed | verifier's best (kept) | first alarm | at the start | at the kept checkpoint | last |"
    lines = [header, "|---|---|---|---|---|---|"]
    for seed, row in rows.items():
        alarm = f"step {row['alarm'][0]}: {row['alarm'][1]}" if row["alarm"] else "none"
        cells = [
            f"strict {row[w]['verifier strict']:.3f} ± {row[w]['se']:.3f}, proxy {row[w]['proxy']:.3f}, "
            f"drift {row[w]['colour drift']:.3f}, diversity {row[w]['diversity']:.3f}"
            for w in ("start", "kept", "last")
        ]
        lines.append(f"| {seed} | step {row['kept_step']} | {alarm} | " + " | ".join(cells) + " |")
    lines += ["", "| mean ± sd over seeds | " + " | ".join(name for name, _ in COLUMNS) + " |",
              "|---|" + "---|" * len(COLUMNS)]  # fmt: skip
    for when in ("start", "kept", "last"):
        values = [mean_sd([row[when][name] for row in rows.values()]) for name, _ in COLUMNS]
        lines.append(f"| {when} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def plot(runs: dict[int, Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (title, key) in zip(axes, (("proxy: colour coverage", PROXY), ("gold: verifier strict", GOLD))):
        series = [evaluations(run) for run in runs.values()]
        steps = [r["step"] for r in series[0]]
        values = [[r[key] for r in s] for s in series]
        means = [statistics.fmean(v) for v in zip(*values)]
        sds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in zip(*values)]
        ax.plot(steps, means, color="black")
        ax.fill_between(
            steps, [m - s for m, s in zip(means, sds)], [m + s for m, s in zip(means, sds)], alpha=0.3
        )
        for run in runs.values():
            alarm = first_alarm(run)
            if alarm:
                ax.axvline(alarm[0], color="red", alpha=0.5, linestyle="--")
            ax.axvline(kept_step(run), color="green", alpha=0.5, linestyle=":")
        ax.set_title(title)
        ax.set_xlabel("iteration")
    legend = "green dotted: kept checkpoint; red dashed: first alarm"
    axes[1].text(0.02, 0.03, legend, transform=axes[1].transAxes, fontsize=8)
    fig.suptitle(f"flow-GRPO on a hackable proxy, {len(runs)} seeds (mean ± sd)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = {seed: args.runs / f"seed{seed}" for seed in args.seeds}
    print(table({seed: seed_row(run) for seed, run in runs.items()}))
    if args.plot is not None:
        plot(runs, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
