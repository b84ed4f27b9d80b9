"""The reward-free monitors (diffrl/evaluation/monitors.py) on images made to have and not
to have each artefact, against their formulas computed a second way."""

from __future__ import annotations

import colorsys
import math

import torch

from diffrl.evaluation import monitors


def _smooth(size=64, seed=0) -> torch.Tensor:
    """A soft blob on a gradient: natural-ish, no periodic structure."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    cx, cy = (torch.rand(2, generator=g) - 0.5).tolist()
    blob = torch.exp(-((x - cx) ** 2 + (y - cy) ** 2) * 4)
    return torch.stack([0.2 + 0.6 * blob, 0.3 + 0.3 * (x + 1) / 2, 0.5 * blob + 0.2 * (y + 1) / 2]).clamp(
        0, 1
    )


def _with_grid(image: torch.Tensor, period: int = 4, strength: float = 0.15) -> torch.Tensor:
    """The image with a faint lattice of 1-px lines every ``period`` px (PickScore's grid)."""
    out = image.clone()
    out[:, ::period, :] += strength
    out[:, :, ::period] += strength
    return out.clamp(0, 1)


def test_grid_energy_finds_a_lattice_and_not_noise_or_edges():
    import random

    from rewards.shapeworld import grammar
    from rewards.shapeworld.render import render

    smooth = torch.stack([_smooth(seed=s) for s in range(4)])
    noisy = (smooth + 0.1 * torch.randn(smooth.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    prompts = ["a red circle and a blue square", "two green triangles", "a cyan square above a red circle"]
    shapes = torch.stack(
        [
            torch.from_numpy(render(grammar.parse(p), random.Random(0), 64)).permute(2, 0, 1).float() / 255
            for p in prompts
        ]
    )
    for name, images in {"smooth": smooth, "noisy": noisy}.items():
        assert (monitors.grid_energy(images) < 0.02).all(), (name, monitors.grid_energy(images))
    # a rasterised diagonal's staircase is periodic too: the triangles score up to 0.09
    assert (monitors.grid_energy(shapes) < 0.15).all(), monitors.grid_energy(shapes)
    assert (monitors.grid_energy(torch.stack([_with_grid(x) for x in smooth])) > 0.9).all()
    faint = torch.stack([_with_grid(x, period=8, strength=0.04) for x in smooth])
    assert (monitors.grid_energy(faint) > 0.9).all()
    lattice_in_noise = monitors.grid_energy(torch.stack([_with_grid(x, strength=0.05) for x in noisy]))
    assert (lattice_in_noise > 10 * monitors.grid_energy(noisy)).all() and (lattice_in_noise > 0.05).all()


def test_exposure_and_saturation_equal_their_formulas():
    image = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    image[0, :, :2, :] = 1.0  # 16 of 64 pixels clipped white
    lum = 0.2126 * image[:, 0] + 0.7152 * image[:, 1] + 0.0722 * image[:, 2]
    assert torch.allclose(monitors.exposure(image), lum.mean(dim=(1, 2)))
    assert torch.allclose(monitors.overexposed(image), (lum >= 0.98).float().mean(dim=(1, 2)))
    assert monitors.overexposed(image)[0] >= 16 / 64
    hsv = [
        [colorsys.rgb_to_hsv(*image[b, :, i, j].tolist())[1] for i in range(8) for j in range(8)]
        for b in range(2)
    ]
    expected = torch.tensor([sum(row) / len(row) for row in hsv])
    assert torch.allclose(monitors.saturation(image), expected, atol=1e-6)


def test_colour_histograms_and_their_distance():
    red = torch.zeros(1, 3, 4, 4)
    red[:, 0] = 1.0
    blue = torch.zeros(1, 3, 4, 4)
    blue[:, 2] = 1.0
    both = torch.cat([red[..., :2], blue[..., 2:]], dim=-1)
    h_red, h_blue, h_both = (monitors.colour_histogram(x)[0] for x in (red, blue, both))
    assert math.isclose(float(h_red.sum()), 1.0) and int((h_red > 0).sum()) == 1
    assert monitors.histogram_distance(h_red, h_red) == 0.0
    assert math.isclose(monitors.histogram_distance(h_red, h_blue), 1.0)
    assert math.isclose(monitors.histogram_distance(h_both, h_red), 0.5)


def test_spread_across_prompts_and_the_video_monitors():
    a, b = torch.zeros(1, 12), torch.full((1, 12), 0.5)
    same = torch.cat([a, a, a, a])
    assert monitors.spread_across_prompts(same, [0, 0, 1, 1]) == 0.0
    assert math.isclose(
        monitors.spread_across_prompts(torch.cat([a, a, b, b]), [0, 0, 1, 1]), 0.5, rel_tol=1e-6
    )
    assert math.isnan(monitors.spread_across_prompts(same, [0, 0, 0, 0]))

    steady = torch.full((1, 4, 3, 8, 8), 0.5)
    blinking = steady.clone()
    blinking[:, 1::2] = 0.9  # every other frame brighter by 0.4
    calm, flashing = monitors.measure(steady)[0], monitors.measure(blinking)[0]
    assert calm["flicker"] == 0.0 and calm["exposure_drift"] == 0.0
    assert math.isclose(flashing["flicker"], 0.4, rel_tol=1e-5)
    assert math.isclose(flashing["exposure_drift"], 0.4, rel_tol=1e-5)  # frame 3 is bright, frame 0 not
    assert set(monitors.measure(steady[:, 0])[0]) == {
        "grid_energy",
        "overexposed",
        "exposure",
        "saturation",
        "colour_histogram",
    }
