"""Reference NVFP4 / FP8 quantizers against the format specs: hand-picked ties,
saturation, subnormals and zero blocks, and an independent scalar reference decoded
from the bit layouts."""

import math

import pytest
import torch

from diffrl.precision import fake_fp8, fake_nvfp4, nvfp4_scales, round_e2m1, round_e4m3


def e4m3_grid() -> list[tuple[float, int]]:
    """Every finite non-negative E4M3 (e4m3fn) value with its mantissa bits, decoded from
    the bit layout: exponent bias 7, subnormals at exponent 0, S.1111.111 is NaN."""
    out = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            value = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            out.append((value, m))
    return sorted(out)


def nearest_even(value: float, grid: list[tuple[float, int]]) -> float:
    """Round |value| onto ``grid`` to nearest, ties to the even mantissa, saturating."""
    mag = abs(value)
    best = min(grid, key=lambda g: (abs(mag - g[0]), g[1] % 2))
    return math.copysign(best[0], value) if value else 0.0


E2M1 = [(0.0, 0), (0.5, 1), (1.0, 0), (1.5, 1), (2.0, 0), (3.0, 1), (4.0, 0), (6.0, 1)]


@pytest.mark.parametrize(
    "x,expected",
    [
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),  # ties to even
        (0.2, 0.0),
        (0.3, 0.5),
        (2.6, 3.0),
        (4.9, 4.0),
        (5.1, 6.0),
        (6.0, 6.0),
        (7.0, 6.0),
        (1e9, 6.0),  # saturation
        (-0.75, -1.0),
        (-5.0, -4.0),
        (-100.0, -6.0),
        (0.0, 0.0),
    ],
)
def test_e2m1_rounding(x, expected):
    assert round_e2m1(torch.tensor([x])).item() == expected


def test_e2m1_matches_a_nearest_grid_search():
    """The binade-wise torch.round against a search over all eight codes (ties to the
    even code), on every midpoint, its fp32 neighbours and random values."""
    mids = [(a + b) / 2 for (a, _), (b, _) in zip(E2M1, E2M1[1:])]
    edges = torch.tensor(mids + [g for g, _ in E2M1])
    near = torch.cat(
        [edges, torch.nextafter(edges, torch.tensor(10.0)), torch.nextafter(edges, torch.tensor(-1.0))]
    )
    x = torch.cat([near, -near, torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 3])
    expected = torch.tensor([nearest_even(v, E2M1) for v in x.tolist()])
    assert torch.equal(round_e2m1(x), expected)


@pytest.mark.parametrize(
    "x,expected",
    [
        (448.0, 448.0),
        (500.0, 448.0),
        (-1e6, -448.0),  # saturation
        (1 + 1 / 16, 1.0),
        (1 + 3 / 16, 1.25),
        (-(1 + 1 / 16), -1.0),  # ties to even in a binade
        (2.0**-9, 2.0**-9),
        (2.0**-10, 0.0),
        (3 * 2.0**-10, 2.0**-8),  # subnormals and their ties
        (0.0, 0.0),
    ],
)
def test_e4m3_rounding_hand_values(x, expected):
    assert round_e4m3(torch.tensor([x])).item() == expected


def test_e4m3_matches_the_decoded_grid_on_random_values():
    grid = e4m3_grid()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g) * torch.exp(torch.randn(4000, generator=g) * 4)
    ties = torch.tensor([(a + b) / 2 for (a, _), (b, _) in zip(grid, grid[1:])])  # every midpoint
    values = torch.cat([x, ties, -ties])
    expected = torch.tensor([nearest_even(v, grid) for v in values.tolist()])
    assert torch.equal(round_e4m3(values), expected)


def test_fp8_scales_amax_to_the_format_max():
    x = torch.tensor([[0.0, 1.0, -3.0], [0.5, 0.25, 0.0], [0.0, 0.0, 0.0]])
    per_tensor = fake_fp8(x)
    assert per_tensor[0, 2].item() == -3.0 and per_tensor[2].eq(0).all()
    per_row = fake_fp8(x, per_row=True)
    assert per_row[1, 0].item() == 0.5 and per_row[0, 2].item() == -3.0 and per_row[2].eq(0).all()
    scale = 0.5 / 448  # row 1 keeps more precision per row than per tensor
    assert per_row[1, 1].item() == pytest.approx(round_e4m3(torch.tensor(0.25 / scale)).item() * scale)


def test_nvfp4_hand_built_blocks():
    ladder = [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -6]
    rows = [
        [2688.0] + [0.0] * 15,  # tensor amax 2688 -> tensor scale exactly 1; block scale e4m3(448)
        [2 * v for v in ladder],  # block scale 2: every tie of the ladder, scaled
        [0.0] * 16,  # all-zero block: scale 1 (as modelopt), values 0
        [6.375, -6.375, 0.3] + [0.0] * 13,  # scale e4m3(1.0625) = 1 (tie to even): 6.375 saturates
        [6 * 2.0**-9, 2.0**-9] + [0.0] * 14,  # subnormal block scale 2^-9
        [6 * 2.0**-11, 2.0**-12] + [0.0] * 14,  # scale 2^-11 < 2^-9: clamped to 2^-9, not flushed
    ]
    x = torch.tensor([v for r in rows for v in r])
    tensor_scale, block_scale = nvfp4_scales(x)
    assert tensor_scale.item() == 1.0
    assert block_scale.tolist() == [448.0, 2.0, 1.0, 1.0, 2.0**-9, 2.0**-9]
    q = fake_nvfp4(x).reshape(6, 16)
    assert q[0, 0].item() == 2688.0
    assert q[1].tolist() == [2 * round_e2m1(torch.tensor(v)).item() for v in ladder]
    assert q[2].eq(0).all()
    assert q[3, :3].tolist() == [6.0, -6.0, 0.5]
    assert q[4, :2].tolist() == [6 * 2.0**-9, 2.0**-9]
    # 6 * 2^-11 / 2^-9 = 1.5 is on the grid; 2^-12 / 2^-9 = 0.125 rounds to 0
    assert q[5, :2].tolist() == [6 * 2.0**-11, 0.0]


def scalar_nvfp4(values: list[float]) -> list[float]:
    """A second, scalar implementation straight from the spec (float64, no torch)."""
    grid4 = e4m3_grid()
    tensor_scale = max(abs(v) for v in values) / (6 * 448)
    out = []
    for start in range(0, len(values), 16):
        block = values[start : start + 16]
        raw = max(abs(v) for v in block) / (6 * tensor_scale)
        raw = 1.0 if raw == 0 else min(max(raw, 2.0**-9), 448.0)  # modelopt's zero and clamp rules
        scale = nearest_even(raw, grid4) * tensor_scale
        out += [nearest_even(v / scale, E2M1) * scale if scale else 0.0 for v in block]
    return out


def test_nvfp4_matches_the_scalar_reference_on_random_weights():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 64, generator=g) * torch.exp(torch.randn(8, 1, generator=g))
    expected = torch.tensor([scalar_nvfp4(row) for row in [w.flatten().tolist()]][0]).reshape(8, 64)
    torch.testing.assert_close(fake_nvfp4(w), expected, rtol=1e-6, atol=0)


def test_nvfp4_pads_a_ragged_last_block_and_keeps_shape():
    x = torch.randn(3, 18, generator=torch.Generator().manual_seed(2))
    q = fake_nvfp4(x)
    assert q.shape == x.shape
    padded = torch.cat([x, torch.zeros(3, 14)], dim=1)
    assert torch.equal(q, fake_nvfp4(padded)[:, :18])
