"""Image fidelity on ShapeWorld's white canvas: the damage a clause verifier cannot see.

RL against the verifier can raise accuracy while the policy paints a faint texture into
the background or muddies the flat palette colours; neither changes a single clause, so
the reward never reports it (reward hacking in miniature). These per-image measures do:

* ``background_darkness``: mean darkness ``1 - mean(R, G, B)`` over *background* pixels,
  those farther than ``halo`` pixels (Chebyshev) from any object pixel, so that the soft
  edges a model draws around an object are not counted as background damage.
* ``stray_pixels``: the fraction of background pixels that deviate from white by more
  than ``stray_threshold`` in some channel (13/255 by default: a visible tint, well
  below the verifier's 0.3 object threshold, so a stray pixel is never an object).
* ``off_palette``: the fraction of *interior* object pixels (object pixels whose 8
  neighbours are object pixels too) farther than ``palette_tolerance`` (RGB distance in
  [0, 1] units) from every palette colour: washed-out or mixed colours.

The renderer draws hard-edged flat colours on pure white, so on rendered scenes every
measure is exactly 0 (tested); a model scores above 0 by how far it strays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rewards.shapeworld.render import BACKGROUND, PALETTE

_PALETTE = torch.tensor(list(PALETTE.values()), dtype=torch.float32) / 255
FIDELITY_KEYS = ("fidelity/background_darkness", "fidelity/stray_pixels", "fidelity/off_palette")


def _dilate(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """(B, H, W) boolean mask grown by ``radius`` pixels in every direction (a square)."""
    if radius <= 0:
        return mask
    grown = F.max_pool2d(mask.float().unsqueeze(1), 2 * radius + 1, stride=1, padding=radius)
    return grown.squeeze(1) > 0


def _erode(mask: torch.Tensor) -> torch.Tensor:
    """Pixels whose whole 3x3 neighbourhood is in ``mask`` (beyond the border counts as out)."""
    outside = F.pad((~mask).float().unsqueeze(1), (1, 1, 1, 1), value=1.0)
    touches_outside = F.max_pool2d(outside, 3, stride=1).squeeze(1) > 0
    return mask & ~touches_outside


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-image mean of ``values`` over ``mask`` (0 where the mask is empty)."""
    count = mask.flatten(1).sum(1)
    total = (values * mask).flatten(1).sum(1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def fidelity(
    batch: torch.Tensor,
    fg_threshold: float = 0.3,
    halo: int = 1,
    stray_threshold: float = 0.05,
    palette_tolerance: float = 0.15,
) -> dict[str, torch.Tensor]:
    """Per-image fidelity measures of a (B, 3, H, W) batch in [0, 1] (see the module doc).

    ``fg_threshold`` is the verifier's: a pixel is an object pixel when some channel is
    further than that from white.
    """
    batch = batch.float().clamp(0, 1)
    white = torch.tensor(BACKGROUND, dtype=torch.float32, device=batch.device).view(1, 3, 1, 1) / 255
    deviation = (batch - white).abs().amax(1)  # (B, H, W)
    objects = deviation > fg_threshold
    background = ~_dilate(objects, halo)
    darkness = (1 - batch.mean(1)).clamp(min=0)
    interior = _erode(objects)
    pixels = batch.permute(0, 2, 3, 1).unsqueeze(-2)  # (B, H, W, 1, 3)
    nearest = (pixels - _PALETTE.to(batch.device)).pow(2).sum(-1).sqrt().amin(-1)  # (B, H, W)
    return {
        "fidelity/background_darkness": _masked_mean(darkness, background),
        "fidelity/stray_pixels": _masked_mean((deviation > stray_threshold).float(), background),
        "fidelity/off_palette": _masked_mean((nearest > palette_tolerance).float(), interior),
    }
