"""ShapeWorld fidelity measures against rendered ground truth, planted damage and a
pixel-by-pixel reference implementation."""

import random

import numpy as np
import pytest
import torch

import rewards
from rewards.shapeworld import grammar
from rewards.shapeworld.fidelity import FIDELITY_KEYS, fidelity
from rewards.shapeworld.render import PALETTE, Placed, draw, render


def _batch(images):
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255


def _rendered(n, seed=0):
    rnd = random.Random(seed)
    train, _ = grammar.split()
    return _batch([render(grammar.parse(p), rnd) for p in rnd.sample(train, n)])


def _reference(image, fg=0.3, halo=1, stray=0.05, tol=0.15):
    """The three measures of one (3, H, W) image, pixel by pixel with Python loops."""
    _, h, w = image.shape
    px = image.permute(1, 2, 0).tolist()
    palette = [tuple(c / 255 for c in rgb) for rgb in PALETTE.values()]
    obj = [[max(abs(1 - c) for c in px[y][x]) > fg for x in range(w)] for y in range(h)]

    def near(y, x, r, grid, want):
        cells = [
            grid[j][i]
            for j in range(y - r, y + r + 1)
            for i in range(x - r, x + r + 1)
            if 0 <= j < h and 0 <= i < w
        ]
        inside = all(
            0 <= j < h and 0 <= i < w for j in range(y - r, y + r + 1) for i in range(x - r, x + r + 1)
        )
        return any(cells) if want == "any" else (all(cells) and inside)

    dark, strays, bg, off, interior = 0.0, 0, 0, 0, 0
    for y in range(h):
        for x in range(w):
            p = px[y][x]
            if not near(y, x, halo, obj, "any"):
                bg += 1
                dark += max(0.0, 1 - sum(p) / 3)
                strays += max(abs(1 - c) for c in p) > stray
            if obj[y][x] and near(y, x, 1, obj, "all"):
                interior += 1
                off += min(sum((a - b) ** 2 for a, b in zip(p, q)) ** 0.5 for q in palette) > tol
    return [dark / bg if bg else 0.0, strays / bg if bg else 0.0, off / interior if interior else 0.0]


def test_rendered_scenes_are_perfectly_clean():
    out = fidelity(_rendered(64))
    for key in FIDELITY_KEYS:
        assert torch.equal(out[key], torch.zeros(64)), key


def test_a_uniform_background_tint_is_measured_exactly_and_counted_as_stray_above_threshold():
    clean = _rendered(8)
    white = (clean == 1).all(1, keepdim=True)
    for tint, stray in ((0.03, 0.0), (0.1, 1.0)):
        tinted = torch.where(white, clean - tint, clean)
        out = fidelity(tinted)
        torch.testing.assert_close(
            out["fidelity/background_darkness"], torch.full((8,), tint), atol=1e-6, rtol=0
        )
        assert torch.equal(out["fidelity/stray_pixels"], torch.full((8,), stray))
        assert torch.equal(out["fidelity/off_palette"], torch.zeros(8))  # objects untouched


def test_a_soft_edge_next_to_an_object_is_not_background_damage():
    image = _batch([draw([Placed("blue", "square", 10, 10, 8)])])
    soft = image.clone()
    soft[:, :, 9, 10:18] = 0.8  # a one-pixel grey fringe just above the square
    assert torch.equal(fidelity(soft)["fidelity/stray_pixels"], torch.zeros(1))
    far = image.clone()
    far[:, :, 1, 1] = 0.8  # the same grey, far from the object: one stray pixel
    out = fidelity(far)
    background = 32 * 32 - 10 * 10  # the 8x8 square grown by the 1-pixel halo
    assert float(out["fidelity/stray_pixels"]) == pytest.approx(1 / background)


def test_washed_out_objects_are_off_palette():
    image = _batch([draw([Placed("red", "square", 4, 4, 10)])])
    washed = torch.where(
        (image < 1).any(1, keepdim=True), torch.tensor([0.6, 0.35, 0.35]).view(1, 3, 1, 1), image
    )
    assert float(fidelity(image)["fidelity/off_palette"]) == 0.0
    assert float(fidelity(washed)["fidelity/off_palette"]) == 1.0


def test_matches_a_pixel_by_pixel_reference_on_noisy_model_like_images():
    gen = torch.Generator().manual_seed(0)
    clean = _rendered(6, seed=3)
    noisy = (clean + 0.08 * torch.randn(clean.shape, generator=gen)).clamp(0, 1)
    out = fidelity(noisy)
    got = torch.stack([out[k] for k in FIDELITY_KEYS], 1)
    want = torch.tensor([_reference(img) for img in noisy])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[:, 1] > 0).all() and (got[:, 1] < 1).all()  # neither check is trivially 0 or 1


def test_verifier_logs_fidelity_and_its_background_penalty_ranks_the_cleaner_image_first():
    prompt = "a red square"
    image = _batch([draw([Placed("red", "square", 10, 10, 10)])])
    dirty = image.clone()
    dirty[:, :, 0:4, 0:32] = 0.85  # a band of texture across the top of the canvas
    plain = rewards.build("shapeworld")
    penalised = rewards.build("shapeworld", background_penalty=2.0)
    both = torch.cat([image, dirty])
    logs = plain(both, [prompt] * 2)
    assert torch.equal(logs["shapeworld"], torch.ones(2))  # the verifier alone cannot tell them apart
    stray = logs["fidelity/stray_pixels"]
    assert stray[0] == 0 and stray[1] > 0.1
    torch.testing.assert_close(penalised(both, [prompt] * 2)["shapeworld"], 1 - 2.0 * stray)
    with pytest.raises(ValueError, match="background_penalty"):
        rewards.build("shapeworld", background_penalty=-1)
