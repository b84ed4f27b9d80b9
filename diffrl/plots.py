"""Small PIL line charts and image sheets (no plotting library needed): training reports
and the per-evaluation sample sheet."""

from __future__ import annotations

import math

from PIL import Image, ImageDraw

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127)]


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def line_panel(draw: ImageDraw.ImageDraw, box, title: str, xlabel: str, series) -> None:
    """``series``: (label, xs, ys) triples; None / non-finite points are skipped."""
    x0, y0, x1, y1 = box
    draw.rectangle(box, outline=(0, 0, 0))
    draw.text((x0, y0 - 14), title, fill=(0, 0, 0))
    draw.text((x1 - 8 * len(xlabel), y1 + 3), xlabel, fill=(90, 90, 90))
    xs = _finite([x for _, sx, sy in series for x, y in zip(sx, sy) if y is not None])
    ys = _finite([y for _, _, sy in series for y in sy])
    if not xs or not ys:
        draw.text((x0 + 8, y0 + 8), "no data", fill=(120, 120, 120))
        return
    lo_x, hi_x = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    lo_y, hi_y = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    draw.text((x0 + 2, y0 + 2), f"{hi_y:.4g}", fill=(90, 90, 90))
    draw.text((x0 + 2, y1 - 12), f"{lo_y:.4g}", fill=(90, 90, 90))
    draw.text((x0, y1 + 3), f"{lo_x:.4g}", fill=(90, 90, 90))

    def at(x, y):
        return x0 + (x - lo_x) / (hi_x - lo_x) * (x1 - x0), y1 - (y - lo_y) / (hi_y - lo_y) * (y1 - y0)

    for i, (label, sx, sy) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        pts = [at(x, y) for x, y in zip(sx, sy) if y is not None and math.isfinite(y)]
        if len(pts) > 1:
            draw.line(pts, fill=colour, width=2)
        for p in pts if len(pts) < 30 else []:
            draw.ellipse((p[0] - 2, p[1] - 2, p[0] + 2, p[1] + 2), fill=colour)
        draw.text((x0 + 60, y0 + 4 + 12 * i), label, fill=colour)


def panels(specs, columns: int = 3, size=(380, 240)) -> Image.Image:
    """A sheet of line panels: ``specs`` are (title, xlabel, series) triples."""
    rows = max(1, math.ceil(len(specs) / columns))
    w, h = size
    image = Image.new("RGB", (w * columns, h * rows), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for i, (title, xlabel, series) in enumerate(specs):
        c, r = i % columns, i // columns
        line_panel(draw, (c * w + 40, r * h + 24, (c + 1) * w - 16, (r + 1) * h - 24), title, xlabel, series)
    return image


def image_sheet(images, captions: list[str], columns: int = 4, tile: int = 128) -> Image.Image:
    """Images (N, 3, H, W) in [0, 1] (video: the first frame) in a grid with captions."""
    n = len(images)
    rows = max(1, math.ceil(n / columns))
    sheet = Image.new("RGB", (tile * columns, (tile + 14) * rows), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, (image, caption) in enumerate(zip(images, captions)):
        frame = image[0] if image.ndim == 4 else image
        arr = (frame.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy()
        x, y = (i % columns) * tile, (i // columns) * (tile + 14)
        sheet.paste(Image.fromarray(arr).resize((tile, tile), Image.NEAREST), (x, y))
        draw.text((x + 2, y + tile + 1), caption[:tile // 6], fill=(0, 0, 0))
    return sheet
