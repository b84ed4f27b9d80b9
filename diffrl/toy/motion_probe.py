"""Does the toy video model read the direction word? The video counterpart of
:func:`diffrl.toy.relation_probe.position_mass`.

From almost pure noise (sigma 0.98) the x0 prediction is the model's mean clip for the
caption, and the direction word is the only thing that says which way the object goes.
For each direction, over every colour-shape caption, the probe reports the shift of the
predicted darkness centroid from the first frame to the last, along the named direction,
in pixels. A model that reads the word gives up to ``step_px x (frames - 1)`` (12 px for
the shipped clips); one that ignores it moves every caption's object the same way, so the
shifts of opposite words cancel and their mean over the four directions is 0.
"""

from __future__ import annotations

import itertools

import torch

from diffrl.toy.relation_probe import darkness_from_noise
from rewards.shapeworld import grammar
from rewards.shapeworld.video import DIRECTIONS


def _centroids(dark: torch.Tensor) -> torch.Tensor:
    """(B, F, 2) darkness centroids (x, y) in pixels of (B, F, H, W) maps."""
    h, w = dark.shape[-2:]
    ys, xs = torch.arange(h).float() + 0.5, torch.arange(w).float() + 0.5
    total = dark.sum((-2, -1)).clamp_min(1e-8)
    return torch.stack([(dark.sum(-2) * xs).sum(-1) / total, (dark.sum(-1) * ys).sum(-1) / total], dim=-1)


@torch.no_grad()
def motion_mass(pipe, frames: int = 5, sigma: float = 0.98, seed: int = 0) -> dict[str, float]:
    """Per direction: the mean first-to-last-frame shift (px) of the x0 prediction's
    darkness centroid along that direction, over all 18 objects; ``mean``: their mean."""
    out = {}
    size = pipe.config.resolution
    for direction, (ux, uy) in DIRECTIONS.items():
        captions = [
            f"a {c} {s} moving {direction}" for c, s in itertools.product(grammar.COLOURS, grammar.SHAPES)
        ]
        c = _centroids(darkness_from_noise(pipe, captions, (3, frames, size, size), sigma, seed))
        shift = c[:, -1] - c[:, 0]
        out[direction] = float((shift[:, 0] * ux + shift[:, 1] * uy).mean())
    out["mean"] = sum(out.values()) / len(DIRECTIONS)
    return out


__all__ = ["motion_mass"]
