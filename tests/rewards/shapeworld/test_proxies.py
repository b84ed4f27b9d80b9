"""The hackable proxy (rewards/shapeworld/proxies.py): it pays for the named colours'
share of the canvas, so a canvas painted in them beats a correct drawing that the verifier
passes, which is what makes it a reward to demonstrate hacking with."""

from __future__ import annotations

import random

import torch

from rewards import build
from rewards.shapeworld import grammar
from rewards.shapeworld.render import PALETTE, render


def test_a_painted_canvas_outscores_a_correct_drawing_the_verifier_passes():
    prompt = "a red circle and a blue square"
    drawn = (
        torch.from_numpy(render(grammar.parse(prompt), random.Random(0), 32)).permute(2, 0, 1).float() / 255
    )
    painted = torch.ones(3, 32, 32)
    painted[:, :, :16] = torch.tensor(PALETTE["red"]).view(3, 1, 1) / 255
    painted[:, :, 16:] = torch.tensor(PALETTE["blue"]).view(3, 1, 1) / 255
    images = torch.stack([drawn, painted])
    proxy = build("shapeworld_colour_coverage")(images, [prompt, prompt])["shapeworld_colour_coverage"]
    verdict = build("shapeworld")(images, [prompt, prompt])["shapeworld_strict"]
    assert verdict.tolist() == [1.0, 0.0]
    assert proxy[1] == 1.0 and 0.0 < proxy[0] < 0.5
    # the share of pixels within the tolerance of a named colour, counted a second way
    colours = torch.tensor([PALETTE["red"], PALETTE["blue"]]).float() / 255
    distance = (drawn.permute(1, 2, 0)[..., None, :] - colours).norm(dim=-1).min(-1).values
    assert torch.isclose(proxy[0], (distance <= 0.25).float().mean())
