"""Single-object position captions: a pretraining-only caption kind for the ShapeWorld toy.

"a red circle to the left" / "to the right" / "above" / "below", with the one object drawn
in that half of the image. The RL grammar (:mod:`rewards.shapeworld.grammar`), its
verifier and its held-out split do not know these captions; they exist to give the
relation words an additive signal before the relations themselves are learnt.

Why (``docs/BENCHMARKS.md``, "A ShapeWorld base that reads relation words"): in a relation
caption the word only lowers the loss jointly with which noun is the subject and where it
is drawn (a three-way interaction), so a model trained on relations alone learns colours
and shapes first and never reads the word. A position caption makes the word a two-way
(word x half) term, which is learnt quickly when enough training falls at the noise levels
where layout is decided. This is the two-stage recipe of Chang et al. 2024 ("Skews in the
phenomenon space hinder generalization in text-to-image generation", arXiv 2403.16394:
single objects first, then pairs) and the "isolated factors first" finding of Okawa et al.
2023 (arXiv 2310.09336).

Every caption is the prefix of a relation caption ("a red circle to the left" of "a red
circle to the left of a blue square"), so all its words are already in the toy tokenizer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

from rewards.shapeworld import grammar
from rewards.shapeworld.render import Placed, draw

POSITIONS = ("to the left", "to the right", "above", "below")
OPPOSITE = {"to the left": "to the right", "to the right": "to the left", "above": "below", "below": "above"}
_RE = re.compile(rf"^a ({'|'.join(grammar.COLOURS)}) ({'|'.join(grammar.SHAPES)}) ({'|'.join(POSITIONS)})$")


@dataclass(frozen=True)
class PositionSpec:
    """One object of ``colour`` and ``shape`` in the ``position`` half of the image."""

    colour: str
    shape: str
    position: str
    kind: str = "position"

    def caption(self) -> str:
        return f"a {self.colour} {self.shape} {self.position}"


def parse(caption: str) -> PositionSpec | None:
    """The :class:`PositionSpec` of a position caption, or None for any other text."""
    m = _RE.match(" ".join(caption.lower().split()))
    return PositionSpec(*m.groups()) if m else None


def captions(exclude_heldout_counts: bool = True, seed: int = 0) -> list[str]:
    """Every position caption (18 objects x 4 positions), in a fixed order.

    With ``exclude_heldout_counts`` an object whose single-object prompt ("a red circle")
    is held out by :func:`grammar.split` gets no position caption: a caption that draws it
    alone would show the held-out count prompt all but verbatim. Those objects learn their
    side from relation captions only.
    """
    held_counts, _ = grammar.heldout_combinations(seed)
    return [
        PositionSpec(c, s, p).caption()
        for c, s in grammar.THINGS
        if not (exclude_heldout_counts and (1, c, s) in held_counts)
        for p in POSITIONS
    ]


def in_half(position: str, obj: Placed, resolution: int) -> bool:
    """Whether the whole box of ``obj`` lies in the ``position`` half (image y grows downward)."""
    half = resolution / 2
    return {
        "to the left": obj.x + obj.size <= half,
        "to the right": obj.x >= half,
        "above": obj.y + obj.size <= half,
        "below": obj.y >= half,
    }[position]


def layout(spec: PositionSpec, rnd: random.Random, resolution: int = 32, grid: int | None = None) -> Placed:
    """The object placed uniformly within its half: a cell of the ``grid`` lattice in that
    half (as :func:`rewards.shapeworld.render.layout` places objects), or a free box inside it."""
    if grid:
        cells = resolution // grid
        cols, rows = range(cells), range(cells)
        half = range(cells // 2) if spec.position in ("to the left", "above") else range(cells // 2, cells)
        if spec.position in ("to the left", "to the right"):
            cols = half
        else:
            rows = half
        return Placed(
            spec.colour, spec.shape, grid * rnd.choice(cols) + 1, grid * rnd.choice(rows) + 1, grid - 2
        )
    size = rnd.randint(max(4, 9 * resolution // 32), max(5, 12 * resolution // 32))
    while True:
        obj = Placed(
            spec.colour,
            spec.shape,
            rnd.randint(0, resolution - size),
            rnd.randint(0, resolution - size),
            size,
        )
        if in_half(spec.position, obj, resolution):
            return obj


def render(
    spec: PositionSpec, rnd: random.Random, resolution: int = 32, grid: int | None = None
) -> np.ndarray:
    """A uint8 (H, W, 3) image of the one object in its half."""
    return draw([layout(spec, rnd, resolution, grid)], resolution)


def corrupt(spec: PositionSpec, rnd: random.Random) -> PositionSpec:
    """A scene that violates the caption in one way: the opposite half, another colour or
    another shape (``caption_noise`` for position captions)."""
    what = rnd.choice(("position", "colour", "shape"))
    if what == "position":
        return PositionSpec(spec.colour, spec.shape, OPPOSITE[spec.position])
    if what == "colour":
        return PositionSpec(
            rnd.choice([c for c in grammar.COLOURS if c != spec.colour]), spec.shape, spec.position
        )
    return PositionSpec(
        spec.colour, rnd.choice([s for s in grammar.SHAPES if s != spec.shape]), spec.position
    )


__all__ = [
    "OPPOSITE",
    "POSITIONS",
    "PositionSpec",
    "captions",
    "corrupt",
    "in_half",
    "layout",
    "parse",
    "render",
]
