"""Methods compared over seeds (``scripts/report.py NAME=DIR1,DIR2,DIR3``): each method is a
group of runs that differ only in seed, and every evaluation figure is summarised across
the group as a mean with its spread (sample standard deviation and min..max over seeds),
next to the evaluation's own standard error (over prompts, averaged over seeds).

Only evaluation steps present in every run of a group are aggregated, so a run stopped
early never silently shortens another's curve. The headline is held-out strict accuracy:
``eval/shapeworld_strict/mean`` for images, or whichever ``eval/<reward>_strict/mean`` the
runs log (``shapeworld_video_strict`` for the video world).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

HELDOUT = "eval/shapeworld_strict/mean"
NFE = "nfe"  # x axis: transformer evaluations spent on rollouts so far (Sol-RL's exploration included)
DARKNESS = "eval/fidelity/background_darkness/mean"
DIVERSITY = "eval/diversity"


@dataclass
class Spread:
    mean: float
    sd: float  # sample standard deviation over seeds (0 for one seed)
    lo: float
    hi: float
    n: int

    def text(self, digits: int = 3) -> str:
        if self.n == 1:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.sd:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


def spread(values: list[float]) -> Spread:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return Spread(statistics.fmean(values), sd, min(values), max(values), len(values))


def headline_key(groups: dict[str, list[list[dict]]]) -> str:
    """:data:`HELDOUT` if the runs log it, else the first ``eval/<reward>_strict/mean`` they log."""
    keys = {k for group in groups.values() for rows in group for row in rows for k in row}
    if HELDOUT in keys:
        return HELDOUT
    strict = sorted(k for k in keys if k.startswith("eval/") and k.endswith("_strict/mean"))
    return strict[0] if strict else HELDOUT


def eval_rows(rows: list[dict], key: str = HELDOUT) -> dict[int, dict]:
    """Evaluation rows of one run by step (the last one wins if a step repeats)."""
    return {r["step"]: r for r in rows if r.get(key) is not None}


def cumulative_nfe(rows: list[dict]) -> dict[int, float]:
    """Rollout NFE spent up to and including each step (``rollout/nfe`` summed over the
    iterations so far; an evaluation-only row, step 0, adds nothing): the x axis that compares
    a tree, a pool and independent rollouts at equal sampling cost."""
    total, out = 0.0, {}
    for row in sorted(rows, key=lambda r: r["step"]):
        total += row.get("rollout/nfe") or 0.0
        out[row["step"]] = total
    return out


def common_steps(group: list[list[dict]], key: str = HELDOUT) -> list[int]:
    steps = None
    for rows in group:
        mine = set(eval_rows(rows, key))
        steps = mine if steps is None else steps & mine
    return sorted(steps or [])


def curve(
    group: list[list[dict]], key: str, x: str = "step", ratio_to_start: bool = False, headline: str = HELDOUT
) -> list[tuple]:
    """(x mean, Spread) per common evaluation step (the steps where every run logs
    ``headline``); ``ratio_to_start`` divides each run's value by its value at step 0 (the
    base), and gives no points for runs evaluated only later (a ratio to a trained model's
    value would read as one to the base)."""
    runs = [eval_rows(rows, headline) for rows in group]
    nfe = [cumulative_nfe(rows) for rows in group] if x == NFE else None
    steps = common_steps(group, headline)
    if ratio_to_start and (not steps or steps[0] != 0):
        return []
    out = []
    for step in steps:
        values = [evals[step].get(key) for evals in runs]
        if any(v is None for v in values):
            continue
        if ratio_to_start:
            starts = [evals[steps[0]].get(key) for evals in runs]
            values = [v / s if s else float("nan") for v, s in zip(values, starts)]
        xs = [totals[step] for totals in nfe] if nfe else [evals[step].get(x, step) for evals in runs]
        out.append((statistics.fmean(xs), spread(values)))
    return out


def _mean_cell(points: dict, step, digits: int = 3, suffix: str = "") -> str:
    got = points.get(step)
    return f"{got.mean:.{digits}f}{suffix}" if got else "-"


def methods_table(groups: dict[str, list[list[dict]]]) -> str:
    """One Markdown row per method and evaluation step: held-out strict (mean ± sd over
    seeds [min, max]), the evaluation's standard error, training strict, background
    darkness and diversity as ratios to the method's own start, wall minutes and the
    rollout NFE spent (mean over seeds)."""
    lines = [
        "| method | seeds | iteration | minutes | rollout NFE | held-out strict (mean ± sd [min, max] over "
        "seeds) | eval SE | "
        "training strict | darkness x base | diversity x base |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    key = headline_key(groups)
    for name, group in groups.items():
        se = dict(curve(group, key.replace("/mean", "/se"), headline=key))
        train = dict(curve(group, key.replace("eval/", "eval_train/", 1), headline=key))
        darkness = dict(curve(group, DARKNESS, ratio_to_start=True, headline=key))
        diversity = dict(curve(group, DIVERSITY, ratio_to_start=True, headline=key))
        minutes = dict(curve(group, "wall_time", headline=key))
        nfe = [cumulative_nfe(rows) for rows in group]
        for step, value in curve(group, key, headline=key):
            spent = statistics.fmean(totals.get(step, 0.0) for totals in nfe)
            spent = f"{spent:,.0f}" if spent else "-"
            lines.append(
                f"| {name} | {len(group)} | {step:g} | {minutes[step].mean / 60:.1f} | {spent} | "
                f"{value.text()} | "
                f"{_mean_cell(se, step)} | {_mean_cell(train, step)} | "
                f"{_mean_cell(darkness, step, 2, 'x')} | {_mean_cell(diversity, step, 2, 'x')} |"
            )
    return "\n".join(lines) + "\n"


def group_panels(groups: dict[str, list[list[dict]]]) -> list[tuple]:
    """Plot specs (title, xlabel, series) of the seed means: held-out strict against
    iteration, wall time and rollout NFE, training strict, darkness and diversity against
    iteration."""

    headline = headline_key(groups)

    def means(key, x="step", ratio=False):
        out = []
        for name, group in groups.items():
            points = curve(group, key, x, ratio, headline)
            out.append((f"{name} (x{len(group)})", [px for px, _ in points], [v.mean for _, v in points]))
        return out

    return [
        ("held-out strict, mean over seeds", "step", means(headline)),
        ("held-out strict vs wall time", "seconds", means(headline, "wall_time")),
        ("held-out strict vs rollout NFE", "transformer evaluations", means(headline, NFE)),
        ("training strict, mean over seeds", "step", means(headline.replace("eval/", "eval_train/", 1))),
        ("background darkness x base", "step", means(DARKNESS, ratio=True)),
        ("diversity x base", "step", means(DIVERSITY, ratio=True)),
    ]
