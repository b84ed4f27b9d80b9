"""Training report from one or more run directories (their ``metrics.jsonl``), overlaid:
reward against step and against wall time, the held-out headline metric, KL, clip
fraction, diversity, and for Sol-RL runs the stage times and the low-precision vs BF16
rank agreement. Writes ``report.png`` and ``summary.md``.

    python scripts/report.py outputs/toy_flowgrpo
    python scripts/report.py outputs/toy_flowgrpo outputs/toy_solrl --out outputs/report

Several seeds of one method: NAME=DIR1,DIR2,DIR3. The summary then adds a methods table
(held-out strict as mean ± sd [min, max] over seeds, the evaluation's standard error,
training strict, darkness and diversity against the base) and the plot starts with the
seed means (diffrl/evaluation/seed_groups.py):

    python scripts/report.py anchor=runs/a0,runs/a1,runs/a2 plain=runs/p0,runs/p1,runs/p2 --out report
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffrl.evaluation.plots import panels  # noqa: E402
from diffrl.evaluation.seed_groups import group_panels, methods_table  # noqa: E402

STAGES = ("time/explore", "time/regenerate", "time/rollout", "time/update", "time/sync")


class ReportError(ValueError):
    pass


def load_run(path: Path) -> list[dict]:
    metrics = Path(path) / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(
            f"'{path}' has no metrics.jsonl; pass a run directory (output_dir of a training run)"
        )
    from diffrl.evaluation.summary import read_metrics

    return read_metrics(metrics, warn=print)


def headline(rows: list[dict]) -> str | None:
    keys = {k for r in rows for k in r if k.startswith("eval/") and k.endswith("/mean")}
    strict = sorted(k for k in keys if k.endswith("_strict/mean"))
    return strict[0] if strict else (sorted(keys)[0] if keys else None)


def series(runs: dict[str, list[dict]], key: str, x: str = "step"):
    return [
        (
            name,
            [r[x] for r in rows if r.get(key) is not None],
            [r[key] for r in rows if r.get(key) is not None],
        )
        for name, rows in runs.items()
    ]


def build_panels(runs: dict[str, list[dict]]):
    main = next((headline(rows) for rows in runs.values() if headline(rows)), None)
    specs = [
        ("reward/mean", "step", series(runs, "reward/mean")),
        ("reward/mean vs wall time", "seconds", series(runs, "reward/mean", "wall_time")),
    ]
    if main:
        specs += [
            (f"{main} (held out)", "step", series(runs, main)),
            (f"{main} vs wall time", "seconds", series(runs, main, "wall_time")),
        ]
    for key in ("kl", "approx_kl", "clipfrac", "eval/diversity", "solrl/kendall_tau", "solrl/spearman_rho"):
        if any(key in r for rows in runs.values() for r in rows):
            specs.append((key, "step", series(runs, key)))
    for name, rows in runs.items():
        present = [k for k in STAGES if any(k in r for r in rows)]
        if present:
            specs.append(
                (
                    f"stage seconds: {name}",
                    "step",
                    [(k.removeprefix("time/"), *series({name: rows}, k)[0][1:]) for k in present],
                )
            )
    return specs, main


def summary(runs: dict[str, list[dict]], main: str | None) -> str:
    lines = [
        "| run | iterations | wall time (min) | reward first -> last 10 | "
        f"{main or 'held-out'} first -> last (best) | mean s per stage |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in runs.items():
        train = [r for r in rows if "reward/mean" in r]
        evals = [r[main] for r in rows if main and r.get(main) is not None]
        reward = ([r["reward/mean"] for r in train[:10]], [r["reward/mean"] for r in train[-10:]])
        stages = ", ".join(
            f"{k.removeprefix('time/')} {statistics.mean(r[k] for r in train if k in r):.2f}"
            for k in STAGES
            if any(k in r for r in train)
        )
        rw = f"{statistics.mean(reward[0]):.3f} -> {statistics.mean(reward[1]):.3f}" if train else "-"
        ev = f"{evals[0]:.3f} -> {evals[-1]:.3f} ({max(evals):.3f})" if evals else "-"
        lines.append(
            f"| {name} | {len(train)} | {rows[-1].get('wall_time', 0) / 60:.1f} | {rw} | {ev} | "
            f"{stages or '-'} |"
        )
    return "\n".join(lines) + "\n"


def _base_row(path: str) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ReportError(f"--base-eval {path}: not a scripts/evaluate.py --json file ({err})") from None
    return {"step": 0, "wall_time": 0.0, **{k: v for k, v in record.items() if k.startswith("eval")}}


def _with_base(rows: list[dict], base: dict | None) -> list[dict]:
    """``rows`` with the base's evaluation as step 0 unless the run evaluated step 0 itself."""
    if base is None or any(r.get("step") == 0 for r in rows):
        return rows
    return [base] + rows


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories; NAME=DIR to label one")
    ap.add_argument("--out", help="output directory (default: the first run's)")
    ap.add_argument(
        "--base-eval",
        help="scripts/evaluate.py --json of the base: the step-0 evaluation of runs started "
        "without one (eval.at_start=false), so curves start at the base and fidelity and "
        "diversity read as ratios to it",
    )
    args = ap.parse_args(argv)
    base_row = _base_row(args.base_eval) if args.base_eval else None
    runs, groups = {}, {}
    for spec in args.runs:
        name, sep, paths = spec.partition("=")
        dirs = [Path(p) for p in (paths if sep else spec).split(",") if p]
        if not dirs:
            raise ReportError(f"'{spec}' names no run directory; write NAME=DIR or NAME=DIR1,DIR2,...")
        name = name if sep else dirs[0].name
        if name in groups:
            raise ReportError(f"two runs are named '{name}'; label them NAME=DIR so each name is used once")
        groups[name] = [_with_base(load_run(d), base_row) for d in dirs]
        for i, rows in enumerate(groups[name]):
            runs[name if len(dirs) == 1 else f"{name}/{dirs[i].name}"] = rows
    first = args.runs[0].partition("=")[2] or args.runs[0]
    out = Path(args.out or first.split(",")[0])
    out.mkdir(parents=True, exist_ok=True)
    specs, main_key = build_panels(runs)
    seeded = any(len(g) > 1 for g in groups.values())
    if seeded:
        panels(group_panels(groups)).save(out / "methods.png")  # the seed means alone, for docs
        specs = group_panels(groups) + specs
    panels(specs).save(out / "report.png")
    text = summary(runs, main_key) + (f"\n{methods_table(groups)}" if seeded else "")
    (out / "summary.md").write_text(text)
    print(text)
    print(f"wrote {out / 'report.png'} and {out / 'summary.md'}")
    return out


if __name__ == "__main__":
    try:
        main()
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
