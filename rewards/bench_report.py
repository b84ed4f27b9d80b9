"""Reports of ``scripts/bench_rewards.py``: a Markdown table and a PNG figure (accuracy
against throughput, and score histograms), drawn with PIL so no plotting library is
needed."""

from __future__ import annotations

import math

import torch
from PIL import Image, ImageDraw

# one palette for every chart of the project (diffrl.evaluation.plots uses it too)
COLOURS = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
]


def _fmt(value, digits=3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(results: dict) -> str:
    lines = [
        "| reward | accuracy with ties | tuned threshold (accuracy) | accuracy without ties | "
        "images/s (batch) | latency ms (batch) | peak GiB | score mean +- std |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["rewards"].items():
        acc = r.get("pairwise") or {}
        fastest = max(r["speed"], key=lambda s: s["images_per_s"]) if r.get("speed") else {}
        smallest = r["speed"][0] if r.get("speed") else {}
        stats = r["scores"]
        tuned = (
            f"{_fmt(acc.get('best_tie_threshold'), 4)} ({_fmt(acc.get('accuracy_at_best_threshold'))})"
            if acc
            else "-"
        )
        lines.append(
            f"| {name} | {_fmt(acc.get('accuracy_with_ties'))} | {tuned} | "
            f"{_fmt(acc.get('accuracy_without_ties'))} "
            f"| {_fmt(fastest.get('images_per_s'), 1)} ({fastest.get('batch_size', '-')}) "
            f"| {_fmt(smallest.get('latency_ms'), 1)} ({smallest.get('batch_size', '-')}) "
            f"| {_fmt(fastest.get('peak_memory_gib'), 2)} | {stats['mean']:.4g} +- {stats['std']:.3g} |"
        )
    corr = results.get("rank_correlations") or {}
    if corr:
        lines += ["", "| rewards | Spearman | Kendall |", "|---|---|---|"]
        lines += [f"| {k} | {_fmt(v['spearman'])} | {_fmt(v['kendall'])} |" for k, v in corr.items()]
    return "\n".join(lines) + "\n"


def _axes(draw, box, title, xlabel, ylabel):
    x0, y0, x1, y1 = box
    draw.rectangle(box, outline=(0, 0, 0))
    draw.text((x0, y0 - 16), title, fill=(0, 0, 0))
    draw.text(((x0 + x1) // 2 - 40, y1 + 18), xlabel, fill=(0, 0, 0))
    draw.text((x0 - 2, y0 - 2), ylabel, fill=(90, 90, 90), anchor="rb")


def _scatter(draw, box, results):
    x0, y0, x1, y1 = box
    names = list(results["rewards"])
    pts = []
    for name in names:
        r = results["rewards"][name]
        speed = max((s["images_per_s"] for s in r.get("speed", [])), default=None)
        acc = (r.get("pairwise") or {}).get("accuracy_with_ties")
        if speed and acc is not None:
            pts.append((name, math.log10(speed), acc))
    _axes(draw, box, "pairwise accuracy (with ties) vs throughput", "log10 images/s (best batch)", "acc")
    if not pts:
        return
    lo, hi = min(p[1] for p in pts) - 0.5, max(p[1] for p in pts) + 0.5
    for tick in (0.0, 0.5, 1.0):
        y = y1 - tick * (y1 - y0)
        draw.line((x0, y, x0 + 5, y), fill=(0, 0, 0))
        draw.text((x0 + 7, y - 6), f"{tick:.1f}", fill=(0, 0, 0))
    draw.text((x0, y1 + 4), f"{lo:.1f}", fill=(0, 0, 0))
    draw.text((x1 - 24, y1 + 4), f"{hi:.1f}", fill=(0, 0, 0))
    for name, sx, acc in pts:
        x = x0 + (sx - lo) / (hi - lo) * (x1 - x0)
        y = y1 - acc * (y1 - y0)
        colour = COLOURS[names.index(name) % len(COLOURS)]
        draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=colour)
        draw.text((x + 6, y - 6), name, fill=colour)


def _histograms(draw, box, scores: dict[str, torch.Tensor], bins: int = 20):
    x0, y0, x1, y1 = box
    _axes(draw, box, "score histograms (each reward over its own range)", "score (min .. max)", "")
    rows = max(1, len(scores))
    height = (y1 - y0) / rows
    for i, (name, s) in enumerate(scores.items()):
        s = s.double()
        lo, hi = float(s.min()), float(s.max())
        counts = torch.histc(s, bins=bins, min=lo, max=hi if hi > lo else lo + 1)
        top = y0 + i * height
        colour = COLOURS[i % len(COLOURS)]
        peak = float(counts.max()) or 1.0
        width = (x1 - x0) / bins
        for b, c in enumerate(counts.tolist()):
            bar = (height - 18) * c / peak
            draw.rectangle(
                (x0 + b * width + 1, top + height - bar, x0 + (b + 1) * width - 1, top + height), fill=colour
            )
        draw.text((x0 + 4, top + 2), f"{name}  [{lo:.3g}, {hi:.3g}]", fill=colour)


def figure(results: dict, scores: dict[str, torch.Tensor], path) -> None:
    image = Image.new("RGB", (1040, 520), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    _scatter(draw, (60, 40, 500, 460), results)
    _histograms(draw, (560, 40, 1010, 460), scores)
    image.save(path)
