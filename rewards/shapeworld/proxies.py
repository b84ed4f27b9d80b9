"""A hackable proxy reward for ShapeWorld, for showing reward hacking and the guard that
catches it (issue 66; docs/BENCHMARKS.md, "Reward hacking caught on ShapeWorld").

``shapeworld_colour_coverage`` pays for the share of the canvas painted in the colours the
prompt names: each pixel within ``tolerance`` (RGB distance in [0, 1] units) of a named
palette colour counts. Early in training it rewards what the verifier rewards too (the named
colours drawn at all, not the wrong ones); past that it can be raised without drawing the
prompt (bigger objects, extra ones, blobs of colour), which the verifier, the gold panel
that watches it, does not pay for. It is deliberately a bad reward: never train on it for
anything but this demonstration.
"""

from __future__ import annotations

import torch

from rewards.images import to_tensor_batch
from rewards.shapeworld import grammar
from rewards.shapeworld.render import PALETTE


class ColourCoverage:
    name = "shapeworld_colour_coverage"

    def __init__(self, tolerance: float = 0.25):
        if not tolerance > 0:
            raise ValueError(f"shapeworld_colour_coverage: tolerance must be > 0, got {tolerance}")
        self.tolerance = float(tolerance)

    def check_prompts(self, prompts: list[str]) -> None:
        for prompt in prompts:
            grammar.parse(prompt)

    def __call__(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        images = to_tensor_batch(images).float()
        if len(prompts) != len(images):
            raise ValueError(f"shapeworld_colour_coverage: {len(images)} images but {len(prompts)} prompts")
        scores = [self._coverage(image, grammar.parse(prompt)) for image, prompt in zip(images, prompts)]
        return {self.name: torch.stack(scores)}

    def _coverage(self, image: torch.Tensor, spec) -> torch.Tensor:
        colours = sorted({group.colour for group in spec.groups})
        targets = torch.tensor([PALETTE[c] for c in colours], dtype=image.dtype, device=image.device) / 255
        pixels = image.movedim(0, -1).reshape(-1, 3)  # (H W, 3)
        near = torch.cdist(pixels, targets).min(dim=1).values <= self.tolerance
        return near.float().mean()
