"""Outputs of ``scripts/compare.py``: PNG grids (paginated), a self-contained sortable HTML
page and ``scores.jsonl``. Video tiles become a strip of frames in the PNG and an
animated GIF in the HTML."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from PIL import Image, ImageDraw

from diffrl.evaluation.plots import LINE_PX, frame_strip, wrap_caption

LABEL_H = 4 * LINE_PX + 4  # name, score, and the prompt over two lines under the first column
GAP = 6  # px of white between tiles
GROUP_GAP = 18  # more between prompt groups placed side by side
MIN_TILE = 160  # px: room for a caption
STRIP_FRAMES = 4


def to_pil(image) -> Image.Image:
    """A tile's image; video (F, 3, H, W) becomes a horizontal strip of frames."""
    if image.ndim == 4:
        image = frame_strip(image, STRIP_FRAMES, separator=None)  # (3, H, n * W)
    arr = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    return Image.fromarray(arr)


def _caption(tile, main: str | None) -> str:
    if main is None or main not in tile.scores:
        return ""
    delta = tile.delta.get(main)
    return f"{main} {tile.scores[main]:.3g}" + ("" if delta is None else f" ({delta:+.3g})")


def grid_pages(
    tiles,
    columns: list[str],
    main_reward: str | None,
    rows_per_page: int,
    scale: int | None = None,
    groups_per_row: int = 1,
):
    """PIL pages: one group per prompt x seed (its tiles in ``columns`` order, a caption per
    tile: column, main score and its change against base; the prompt and seed under the
    group), ``groups_per_row`` groups side by side (1: one group per row, the sortable
    layout; 3-4: a wide figure for a README), ``rows_per_page`` groups per page. ``scale``
    zooms tiles by an integer factor (default: to ~160 px)."""
    groups = sorted({(t.prompt_index, t.seed) for t in tiles})
    by_key = {(t.prompt_index, t.seed, t.column): t for t in tiles}
    sample = to_pil(tiles[0].image)
    scale = scale or max(1, -(-MIN_TILE // sample.width))
    w, h = sample.width * scale, sample.height * scale
    cell_w, cell_h = w + GAP, h + LABEL_H + GAP
    group_w = cell_w * len(columns) + GROUP_GAP
    pages = []
    for start in range(0, len(groups), rows_per_page):
        chunk = groups[start : start + rows_per_page]
        across = min(groups_per_row, len(chunk))
        down = -(-len(chunk) // across)
        page = Image.new("RGB", (group_w * across - GROUP_GAP + GAP, cell_h * down + GAP), (255, 255, 255))
        draw = ImageDraw.Draw(page)
        for g, (p, s) in enumerate(chunk):
            group = [by_key[(p, s, name)] for name in columns]
            origin = (GAP + (g % across) * group_w, GAP + (g // across) * cell_h)
            _draw_group(page, draw, group, origin, (w, h), main_reward)
        pages.append(page)
    return pages


def _draw_group(page, draw, group, origin, size, main_reward) -> None:
    """One prompt x seed: its tiles left to right with a border each (tiles never run
    together), the column name and main score under each, the prompt under the group."""
    (x0, y), (w, h) = origin, size
    for c, tile in enumerate(group):
        x = x0 + c * (w + GAP)
        page.paste(to_pil(tile.image).resize((w, h), Image.NEAREST), (x, y))
        draw.rectangle((x - 1, y - 1, x + w, y + h), outline=(150, 150, 150))
        for j, text in enumerate((tile.column, _caption(tile, main_reward))):
            draw.text((x, y + h + 2 + j * LINE_PX), text, fill=(0, 0, 0))
    caption = f"seed {group[0].seed}: {group[0].prompt}"
    for j, text in enumerate(wrap_caption(caption, len(group) * (w + GAP) - GAP, lines=2)):
        draw.text((x0, y + h + 2 + (2 + j) * LINE_PX), text, fill=(90, 90, 90))


def write_jsonl(tiles, path: Path) -> None:
    with open(path, "w") as fh:
        for t in tiles:
            fh.write(
                json.dumps(
                    {
                        "prompt": str(t.prompt),
                        "image": getattr(t.prompt, "image", None),  # an editing prompt's source
                        "prompt_index": t.prompt_index,
                        "seed": t.seed,
                        "checkpoint": t.column,
                        "scores": t.scores,
                        "delta_vs_base": t.delta,
                    }
                )
                + "\n"
            )


def _data_uri(tile) -> str:
    buf = io.BytesIO()
    if tile.image.ndim == 4:  # video: an animated GIF
        frames = [to_pil(f) for f in tile.image]
        frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=125, loop=0)
        return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()
    to_pil(tile.image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


_SCRIPT = r"""
function sortBy(col){const t=document.getElementById('grid');const b=t.tBodies[0];
const rows=[...b.rows];const dir=t.dataset.col==col&&t.dataset.dir=='desc'?'asc':'desc';
rows.sort((x,y)=>{const a=parseFloat(x.cells[col].dataset.v),c=parseFloat(y.cells[col].dataset.v);
const av=isNaN(a)?-Infinity:a,cv=isNaN(c)?-Infinity:c;return dir=='desc'?cv-av:av-cv});
rows.forEach(r=>b.appendChild(r));t.dataset.col=col;t.dataset.dir=dir;}
window.addEventListener('load',()=>{const m=location.hash.match(/sort=(\d+)/);if(m)sortBy(+m[1]);
const imgs=[...document.images];
document.body.dataset.imagesOk=imgs.filter(i=>i.complete&&i.naturalWidth>0).length;
document.body.dataset.images=imgs.length;});
"""


def write_html(tiles, columns: list[str], rewards: list[str], path: Path, title: str) -> None:
    """One row per prompt x seed: the prompt, the seed, each column's tile with its
    scores, and one sortable cell per (column, reward) score and delta."""
    by_key = {(t.prompt_index, t.seed, t.column): t for t in tiles}
    rows = sorted({(t.prompt_index, t.seed) for t in tiles})
    sort_cols = [
        (c, r, kind)
        for c in columns
        for r in rewards
        for kind in ("score", "delta")
        if kind == "score" or c != "base"
    ]
    head = "<th>prompt</th><th>seed</th>" + "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    head += "".join(
        f"<th class='s' onclick='sortBy({3 + len(columns) + i - 1})'>{html.escape(c)} {html.escape(r)}"
        f"{' &Delta;' if k == 'delta' else ''}</th>"
        for i, (c, r, k) in enumerate(sort_cols)
    )
    body = []
    for p, s in rows:
        first = by_key[(p, s, columns[0])]
        source = getattr(first.prompt, "image", None)  # an editing prompt names its input image
        label = first.prompt + (f" [{Path(source).name}]" if source else "")
        cells = [f"<td>{html.escape(label)}</td>", f"<td data-v='{s}'>{s}</td>"]
        for c in columns:
            t = by_key[(p, s, c)]
            text = "<br>".join(f"{html.escape(k)} {v:.4g}" for k, v in t.scores.items() if k in rewards)
            cells.append(f"<td><img src='{_data_uri(t)}' alt='{html.escape(c)}'><div>{text}</div></td>")
        for c, r, k in sort_cols:
            t = by_key[(p, s, c)]
            v = (t.scores if k == "score" else t.delta).get(r, float("nan"))
            cells.append(
                f"<td data-v='{v}'>{v:+.4g}</td>" if k == "delta" else f"<td data-v='{v}'>{v:.4g}</td>"
            )
        body.append("<tr>" + "".join(cells) + "</tr>")
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:4px;vertical-align:top}"
        "img{image-rendering:pixelated;width:128px}th.s{cursor:pointer;background:#eef}</style>"
        f"<script>{_SCRIPT}</script></head><body><h1>{html.escape(title)}</h1>"
        "<p>Click a score column to sort (again to reverse). &Delta; is the change against base.</p>"
        f"<table id='grid'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></body></html>"
    )
    Path(path).write_text(page)
