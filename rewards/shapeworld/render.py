"""ShapeWorld renderer: flat-coloured circles, squares and triangles on a white canvas
(striped or solid ones in the late-step world, :func:`textured_colours`).

Scenes are laid out from a :class:`~rewards.shapeworld.grammar.Spec` (so the picture satisfies
the caption) with random sizes and positions; ``corrupt`` makes a scene that violates
exactly one clause, which is what the verifier's negative tests render.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np

from rewards.shapeworld.grammar import COLOURS, SHAPES, Group, Spec

PALETTE = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 200, 20),
    "purple": (140, 40, 180),
    "cyan": (20, 190, 210),
}
BACKGROUND = (255, 255, 255)
# the late-step world's stripes alternate a palette colour with this much of the way to
# white; its solid objects take the mean of the two, so both textures have the same mean
# colour (no low-frequency difference) and every shade keeps its nearest palette colour
STRIPE_TINT = 0.25
GAP = 2  # minimum empty pixels between two objects' boxes, so components never touch
RELATION_MARGIN = 6  # rendered relations: centres at least this far apart along the axis
OPPOSITE = {
    "to the left of": "to the right of",
    "to the right of": "to the left of",
    "above": "below",
    "below": "above",
}


@dataclass(frozen=True)
class Placed:
    """One object: its colour, shape and square bounding box (top-left corner, side), and
    its texture in the late-step world."""

    colour: str
    shape: str
    x: int
    y: int
    size: int
    texture: str | None = None

    @property
    def centre(self) -> tuple[float, float]:
        return (self.x + self.size / 2, self.y + self.size / 2)


def shape_mask(shape: str, size: int) -> np.ndarray:
    """Boolean (size, size) mask, sampled at pixel centres."""
    c = (np.arange(size) + 0.5) - size / 2
    xx, yy = np.meshgrid(c, c)
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "circle":
        return xx**2 + yy**2 <= (size / 2) ** 2
    if shape == "triangle":  # apex at the top centre, base along the bottom edge
        return np.abs(xx) <= (yy + size / 2) / 2
    raise ValueError(f"unknown shape '{shape}'; valid: {', '.join(SHAPES)}")


def textured_colours(colour: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(even-row, odd-row) RGB of each texture of ``colour``: striped alternates the
    palette colour and its tint, solid fills both rows with their mean."""
    base = np.array(PALETTE[colour], dtype=np.float64)
    tint = base + STRIPE_TINT * (255 - base)
    mean = (base + tint) / 2
    return {"striped": (base, tint), "solid": (mean, mean)}


def draw(objects: list[Placed], resolution: int = 32) -> np.ndarray:
    """uint8 (H, W, 3) image of ``objects`` on the white background."""
    image = np.empty((resolution, resolution, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for o in objects:
        region = image[o.y : o.y + o.size, o.x : o.x + o.size]
        mask = shape_mask(o.shape, o.size)
        if o.texture is None:
            region[mask] = PALETTE[o.colour]
            continue
        even, odd = textured_colours(o.colour)[o.texture]
        rows = np.where((np.arange(o.size) % 2 == 0)[:, None, None], even, odd)  # (size, 1, 3)
        shades = np.broadcast_to(np.rint(rows), (o.size, o.size, 3)).astype(np.uint8)
        region[mask] = shades[mask]
    return image


def _size_range(num_objects: int, resolution: int) -> tuple[int, int]:
    """Bigger objects when there are few; scaled from the 32 px design."""
    lo, hi = (9, 12) if num_objects <= 2 else (7, 10)
    return max(4, lo * resolution // 32), max(5, hi * resolution // 32)


def _apart(a: Placed, b: Placed) -> bool:
    return (
        a.x + a.size + GAP <= b.x
        or b.x + b.size + GAP <= a.x
        or a.y + a.size + GAP <= b.y
        or b.y + b.size + GAP <= a.y
    )


def relation_holds(a: Placed, b: Placed, relation: str, margin: float) -> bool:
    """Whether ``a`` is ``relation`` ``b`` (image y grows downward)."""
    (ax, ay), (bx, by) = a.centre, b.centre
    return {
        "to the left of": bx - ax >= margin,
        "to the right of": ax - bx >= margin,
        "above": by - ay >= margin,
        "below": ay - by >= margin,
    }[relation]


def _random_box(
    num_objects: int, rnd: random.Random, resolution: int, grid: int | None
) -> tuple[int, int, int]:
    """(x, y, size): free pixel placement, or one object per cell of a ``grid``-pixel
    lattice (side ``grid - 2``, centred), which matches a patch-``grid`` transformer's
    tokens: every object is then drawn by exactly one token."""
    if grid:
        cells = resolution // grid
        return grid * rnd.randrange(cells) + 1, grid * rnd.randrange(cells) + 1, grid - 2
    lo, hi = _size_range(num_objects, resolution)
    size = rnd.randint(lo, hi)
    return rnd.randint(0, resolution - size), rnd.randint(0, resolution - size), size


def layout(
    spec: Spec, rnd: random.Random, resolution: int = 32, grid: int | None = None, max_tries: int = 1000
) -> list[Placed]:
    """Random non-touching placement of every object of ``spec`` satisfying its relation."""
    things = [(g.colour, g.shape, g.texture) for g in spec.groups for _ in range(g.count)]
    for _ in range(max_tries):
        placed: list[Placed] = []
        for colour, shape, texture in things:
            x, y, size = _random_box(len(things), rnd, resolution, grid)
            obj = Placed(colour, shape, x, y, size, texture)
            if not all(_apart(obj, other) for other in placed):
                break
            placed.append(obj)
        else:
            if spec.relation is None or relation_holds(placed[0], placed[1], spec.relation, RELATION_MARGIN):
                return placed
    raise RuntimeError(f"could not lay out {spec.caption()!r} in {resolution} px after {max_tries} tries")


def render(spec: Spec, rnd: random.Random, resolution: int = 32, grid: int | None = None) -> np.ndarray:
    """A random uint8 image that satisfies ``spec`` (see :func:`layout` for ``grid``)."""
    return draw(layout(spec, rnd, resolution, grid), resolution)


def _other(value: str, choices, rnd: random.Random, avoid=()) -> str:
    return rnd.choice([c for c in choices if c != value and c not in avoid])


def corrupt(spec: Spec, rnd: random.Random) -> Spec:
    """A scene spec that violates one clause of ``spec``: a wrong count, colour, shape or
    texture, a missing object, or the opposite relation. Used to render negative examples."""
    groups = list(spec.groups)
    options = ["colour", "shape"] + (["count"] if spec.kind == "count" else ["drop"])
    options += ["relation"] if spec.relation else []
    options += ["texture"] if spec.groups[0].texture else []
    what = rnd.choice(options)
    i = rnd.randrange(len(groups))
    g = groups[i]
    others = {h.thing for j, h in enumerate(groups) if j != i}
    if what == "count":
        groups[i] = replace(g, count=rnd.choice([n for n in (1, 2, 3, 4) if n != g.count]))
    elif what == "colour":
        avoid = [c for c in COLOURS if (c, g.shape) in others]
        groups[i] = replace(g, colour=_other(g.colour, COLOURS, rnd, avoid))
    elif what == "shape":
        avoid = [s for s in SHAPES if (g.colour, s) in others]
        groups[i] = replace(g, shape=_other(g.shape, SHAPES, rnd, avoid))
    elif what == "texture":
        groups[i] = replace(g, texture="solid" if g.texture == "striped" else "striped")
    elif what == "drop":
        return Spec("count", (groups[1 - i],))
    else:
        return Spec(spec.kind, spec.groups, OPPOSITE[spec.relation])
    return Spec(spec.kind, tuple(groups), spec.relation)


__all__ = ["BACKGROUND", "PALETTE", "Group", "Placed", "corrupt", "draw", "layout", "render", "shape_mask"]
