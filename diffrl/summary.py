"""The before/after table printed at the end of a run, from ``metrics.jsonl``.

Reading the file (not the in-memory history) makes the table cover the whole run even
after a resume: "before" is the first evaluation ever logged, "after" the last.
"""

from __future__ import annotations

import json
from pathlib import Path


def eval_rows(metrics_path: Path) -> list[dict]:
    if not Path(metrics_path).is_file():
        return []
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    return [r for r in rows if any(k.startswith("eval/") for k in r)]


def before_after(metrics_path: Path, headlines: tuple[str, ...] = ()) -> str:
    """A fixed-width table of every ``eval/`` metric at the first and the last evaluation.

    The first of ``headlines`` that was logged (e.g. ``eval/shapeworld_strict/mean``) is
    listed first and marked with ``*``.
    """
    rows = eval_rows(metrics_path)
    if len(rows) < 2:
        return "before/after: fewer than two evaluations were logged (set eval.at_start and eval.every)"
    first, last = rows[0], rows[-1]
    keys = sorted(k for k in last if k.startswith("eval/") and k in first)
    headline = next((h for h in headlines if h in keys), None)
    if headline:
        keys.remove(headline)
        keys.insert(0, headline)
    width = max(len(k) for k in keys) + 2
    lines = [f"{'held-out evaluation':<{width}}{'step ' + str(first['step']):>12}{'step ' + str(last['step']):>12}"
             f"{'change':>10}"]
    for k in keys:
        a, b = first[k], last[k]
        if a is None or b is None:
            change = "n/a"
        elif k == "eval/diversity":
            change = f"{100 * b / a:.0f}%" if a else "n/a"
        else:
            change = f"{b - a:+.3f}"
        mark = "* " if k == headline else "  "
        lines.append(f"{mark}{k:<{width - 2}}{_fmt(a):>12}{_fmt(b):>12}{change:>10}")
    minutes = (last.get("wall_time") or 0) / 60
    lines.append(f"(wall time {minutes:.1f} min; diversity change is after/before)")
    return "\n".join(lines)


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4g}"
