"""The before/after table printed at the end of a run, from ``metrics.jsonl``.

Reading the file (not the in-memory history) makes the table cover the whole run even
after a resume: "before" is the first evaluation ever logged, "after" the last.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path, warn=None) -> list[dict]:
    """The rows of a ``metrics.jsonl``. A run killed while writing leaves a torn last line:
    it is left out (``warn`` is called with a note); a bad line elsewhere is left out too
    and named, since the other rows are still worth reading."""
    lines = Path(path).read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if warn is not None:
                where = "its torn last line" if number == len(lines) else f"line {number}, which is not JSON"
                warn(f"note: {path}: left out {where}")
    return rows


def eval_rows(metrics_path: Path) -> list[dict]:
    if not Path(metrics_path).is_file():
        return []
    rows = read_metrics(metrics_path)
    return [r for r in rows if any(k.startswith("eval/") for k in r)]


PREFIXES = (
    ("eval/", "held-out prompts"),
    ("eval_train/", "training prompts"),
    ("eval_para/", "paraphrases, judged against their originals (gap: original - paraphrase)"),
    ("eval_plain/", "held-out prompts without the refiner"),
    ("eval_para_plain/", "paraphrases without the refiner"),
)


def before_after(metrics_path: Path, headlines: tuple[str, ...] = ()) -> str:
    """A fixed-width table of every evaluation metric at the first and the last evaluation:
    the held-out set (``eval/``) and the training subset (``eval_train/``), each headed by
    its sample count, with ``± se`` where a standard error was logged.

    The first of ``headlines`` that was logged (e.g. ``eval/shapeworld_strict/mean``) is
    listed first and marked with ``*``. Diversity and fidelity (damage) change as a ratio
    after / before, everything else as a difference.
    """
    rows = eval_rows(metrics_path)
    if len(rows) < 2:
        return "before/after: fewer than two evaluations were logged (set eval.at_start and eval.every)"
    first, last = rows[0], rows[-1]
    sections = []  # (title, [(mark + key, before, after, change)])
    for prefix, title in PREFIXES:
        keys = sorted(k for k in last if k.startswith(prefix) and k in first and _is_value(k))
        if not keys:
            continue
        headline = next((h for h in headlines if h in keys), None)
        if headline:
            keys.remove(headline)
            keys.insert(0, headline)
        cells = [
            (
                ("* " if k == headline else "  ") + k,
                _cell(first, k),
                _cell(last, k),
                _change(k, first[k], last[k]),
            )
            for k in keys
        ]
        sections.append((f"{title} (n = {_count(first, prefix)} / {_count(last, prefix)} samples)", cells))
    header = ("evaluation", f"step {first['step']}", f"step {last['step']}", "change")
    every = [header] + [c for _, cells in sections for c in cells]
    # each column as wide as its widest cell, two spaces apart, so long values never touch
    w = [max(len(row[i]) for row in every) + (0 if i == 0 else 2) for i in range(4)]

    def fmt(row):
        return f"{row[0]:<{w[0]}}{row[1]:>{w[1]}}{row[2]:>{w[2]}}{row[3]:>{w[3]}}"

    lines = [fmt(header)]
    for title, cells in sections:
        lines.append(title)
        lines += [fmt(c) for c in cells]
    minutes = (last.get("wall_time") or 0) / 60
    lines.append(
        f"(wall time {minutes:.1f} min; ± is one standard error over prompts; diversity and fidelity "
        "change as after/before)"
    )
    return "\n".join(lines)


def _is_value(key: str) -> bool:
    return key.endswith(("/mean", "/diversity", "/original", "/gap"))


def _count(row: dict, prefix: str) -> str:
    n = row.get(f"{prefix}n")
    return "?" if n is None else str(int(n))


def _cell(row: dict, key: str) -> str:
    value = row[key]
    if key.endswith("/mean"):
        se = row.get(key[: -len("/mean")] + "/se")
    else:  # a paraphrase evaluation's original and gap carry their own (.../gap_se)
        se = row.get(key + "_se")
    if value is None:
        return "n/a"
    return f"{value:.4g} ± {se:.2g}" if se is not None and se == se else f"{value:.4g}"


def _change(key: str, a, b) -> str:
    if a is None or b is None:
        return "n/a"
    if key.endswith("/diversity") or "/fidelity/" in key:
        return f"{b / a:.2f}x" if a else ("1.00x" if b == a else "from 0")
    return f"{b - a:+.3f}"
