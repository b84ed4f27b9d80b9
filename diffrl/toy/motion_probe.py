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


def _shift_along(dark: torch.Tensor, direction: str) -> torch.Tensor:
    """(B,) first-to-last-frame shift (px) of the darkness centroid of (B, F, H, W) maps
    along ``direction``."""
    ux, uy = DIRECTIONS[direction]
    c = _centroids(dark)
    shift = c[:, -1] - c[:, 0]
    return shift[:, 0] * ux + shift[:, 1] * uy


def _per_direction(shifts_for) -> dict[str, float]:
    """``shifts_for(direction, captions)`` -> (N,) shifts, for the 18 colour-shape captions
    of each direction: their means per direction and the mean of those."""
    out = {}
    for direction in DIRECTIONS:
        captions = [
            f"a {c} {s} moving {direction}" for c, s in itertools.product(grammar.COLOURS, grammar.SHAPES)
        ]
        out[direction] = float(shifts_for(direction, captions).mean())
    out["mean"] = sum(out.values()) / len(DIRECTIONS)
    return out


@torch.no_grad()
def motion_mass(pipe, frames: int = 5, sigma: float = 0.98, seed: int = 0) -> dict[str, float]:
    """Per direction: the mean first-to-last-frame shift (px) of the x0 prediction's
    darkness centroid along that direction, over all 18 objects; ``mean``: their mean."""
    shape = (3, frames, pipe.config.resolution, pipe.config.resolution)
    return _per_direction(
        lambda direction, captions: _shift_along(
            darkness_from_noise(pipe, captions, shape, sigma, seed), direction
        )
    )


@torch.no_grad()
def sampled_motion(
    pipe, frames: int = 5, steps: int = 20, seeds: tuple[int, ...] = (0, 1)
) -> dict[str, float]:
    """:func:`motion_mass` on the model's samples instead of its mean from noise: per
    direction, the mean first-to-last shift (px) of each ODE sample's darkness centroid
    along the named direction, over all 18 objects x ``seeds``; ``mean``: their mean.

    Why both: Wan's DiT has only relative (RoPE) position, so from pure noise it cannot put
    its *mean* clip at a place; a model with one frame per token can only move each
    sample's object (seeded by the noise), which :func:`motion_mass` at sigma 0.98 does not
    see. A token that spans the frames carries the motion inside it, and both probes read
    it (docs/BENCHMARKS.md, the video toy). The samples show what a user sees."""

    def shifts(direction: str, captions: list[str]) -> torch.Tensor:
        out = []
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed)
            clips = pipe(captions, num_frames=frames, num_inference_steps=steps, generator=gen)
            out.append(_shift_along(1 - clips.mean(2), direction))  # (B, F, 3, H, W) -> darkness
        return torch.cat(out)

    return _per_direction(shifts)


@torch.no_grad()
def frame_coupling(pipe, frames: int = 5, sigma: float = 0.8, seed: int = 0, batch: int = 8) -> float:
    """How much the other frames' x0 predictions at the same place follow a change of one
    frame's noise, as a share of how much that frame's own prediction follows it: the
    noise of one patch of frame 0 is perturbed and the mean absolute change of the x0
    prediction is compared, the same patch in frames 1.. against frame 0's own.

    A model that ties its frames (a still or slowly moving object is one object in every
    frame) needs this share to be large at the sigmas where the object's place is decided;
    a model that draws each frame alone gives ~0."""
    gen = torch.Generator().manual_seed(seed)
    size = pipe.config.resolution
    patch = size // 4
    x = torch.randn((batch, 3, frames, size, size), generator=gen)
    s = torch.full((batch,), sigma)
    embeds = pipe.text_embeddings(["a red circle moving left"] * batch)
    bumped = x.clone()
    bumped[:, :, 0, :patch, :patch] += torch.randn((batch, 3, patch, patch), generator=gen)
    change = ((x - bumped) - sigma * (pipe.velocity(x, s, embeds) - pipe.velocity(bumped, s, embeds))).abs()
    own = change[:, :, 0, :patch, :patch].mean()
    return float(change[:, :, 1:, :patch, :patch].mean() / own.clamp_min(1e-12))


__all__ = ["frame_coupling", "motion_mass", "sampled_motion"]
