"""Training-report charts (matplotlib) and the per-evaluation sample sheet (PIL).

Charts: every panel has real axis ticks on both axes, its title, its x label, and the
legend *outside* the axes (to their right), so labels never sit on the lines; a chart
is returned as a PIL image so that callers only ``.save`` it. Sheets: each caption is
wrapped to the tile's width over up to three lines instead of being cut off.
"""

from __future__ import annotations

import io
import math
import textwrap

import numpy as np
import torch
from PIL import Image, ImageDraw

from rewards.bench_report import COLOURS

CHAR_PX = 6  # width of a character in PIL's default bitmap font
LINE_PX = 11
CAPTION_LINES = 3


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _points(xs, ys) -> tuple[list[float], list[float]]:
    keep = [(x, y) for x, y in zip(xs, ys) if y is not None and x is not None and math.isfinite(y)]
    return [x for x, _ in keep], [y for _, y in keep]


def panels(specs, columns: int = 3, size=(380, 240)) -> Image.Image:
    """A sheet of line charts: ``specs`` are (title, xlabel, series) triples and a series is
    (label, xs, ys); None / non-finite points are skipped. ``size`` is one panel in pixels
    (about; the legend column adds its width)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    rows = max(1, math.ceil(len(specs) / columns))
    dpi = 100
    fig, axes = plt.subplots(
        rows, columns, figsize=(columns * size[0] * 1.45 / dpi, rows * size[1] / dpi), dpi=dpi, squeeze=False
    )
    for ax in axes.flat[len(specs) :]:
        ax.set_visible(False)
    for ax, (title, xlabel, series) in zip(axes.flat, specs):
        _draw_panel(ax, title, xlabel, series)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    buffer.seek(0)
    return Image.open(buffer).convert("RGB")


def _draw_panel(ax, title: str, xlabel: str, series) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    drawn = 0
    for i, (label, xs, ys) in enumerate(series):
        px, py = _points(xs, ys)
        if not px:
            continue
        colour = tuple(c / 255 for c in COLOURS[i % len(COLOURS)])
        ax.plot(
            px,
            py,
            color=colour,
            linewidth=1.4,
            marker="o" if len(px) < 30 else None,
            markersize=3,
            label=label,
        )
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
        return
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def wrap_caption(caption: str, width_px: int, lines: int = CAPTION_LINES) -> list[str]:
    """``caption`` wrapped to ``width_px`` in the default font, at most ``lines`` lines (the
    last one ends in '...' if text remains)."""
    chars = max(4, width_px // CHAR_PX)
    wrapped = textwrap.wrap(caption, chars, break_long_words=True) or [""]
    if len(wrapped) > lines:
        wrapped = wrapped[:lines]
        wrapped[-1] = wrapped[-1][: chars - 3] + "..."
    return wrapped


def frame_strip(
    clip: torch.Tensor, max_frames: int | None = None, separator: float | None = 0.6
) -> torch.Tensor:
    """A clip (F, 3, H, W) as one image (3, H, n * W (+ n - 1)): its frames left to right,
    ``max_frames`` of them evenly spaced (all by default), with a 1-px line of grey level
    ``separator`` between them (none if ``None``), so that a tile shows the motion."""
    if max_frames is not None and clip.shape[0] > max_frames:
        idx = np.linspace(0, clip.shape[0] - 1, max_frames).round().astype(int)
        clip = clip[list(idx)]
    if separator is None:
        return torch.cat(list(clip), dim=2)
    line = torch.full((3, clip.shape[2], 1), separator, dtype=clip.dtype)
    parts = [part for frame in clip for part in (frame, line)][:-1]
    return torch.cat(parts, dim=2)


def image_sheet(images, captions: list[str], columns: int = 4, tile: int = 128) -> Image.Image:
    """Images (N, 3, H, W) in [0, 1] in a grid, each ``tile`` px high with its caption
    wrapped underneath and a 4-px gutter between tiles. Clips (N, F, 3, H, W) show as frame
    strips (:func:`frame_strip`), their tiles ``F`` times as wide."""
    if images.ndim == 5:
        images = torch.stack([frame_strip(clip) for clip in images])
    n, (height, width) = len(images), images.shape[-2:]
    tile_w = max(1, round(tile * width / height))
    rows = max(1, math.ceil(n / columns))
    gap, text_h = 4, CAPTION_LINES * LINE_PX + 2
    cell_w, cell_h = tile_w + gap, tile + text_h + gap
    sheet = Image.new("RGB", (cell_w * columns + gap, cell_h * rows + gap), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, (image, caption) in enumerate(zip(images, captions)):
        arr = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()
        x, y = gap + (i % columns) * cell_w, gap + (i // columns) * cell_h
        sheet.paste(Image.fromarray(arr).resize((tile_w, tile), Image.NEAREST), (x, y))
        draw.rectangle((x - 1, y - 1, x + tile_w, y + tile), outline=(160, 160, 160))
        for j, line in enumerate(wrap_caption(caption, tile_w)):
            draw.text((x, y + tile + 2 + j * LINE_PX), line, fill=(0, 0, 0))
    return sheet
