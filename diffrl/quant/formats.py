"""Reference (fake) quantizers, exact to the formats: NVFP4 and FP8 E4M3.

They return dequantized fp32 tensors (quantize, then dequantize) so that a model can run
with low-precision numerics on any device, including CPU in CI.

* **FP8 E4M3** (OCP "e4m3fn": 4 exponent bits, bias 7, 3 mantissa bits, no infinities,
  max 448, subnormals down to 2^-9). Values are scaled by amax / 448 per tensor or per
  row, rounded to nearest with ties to even (torch's ``float8_e4m3fn`` cast), and
  saturated at +-448.
* **NVFP4** (NVIDIA's 4-bit float; DESIGN.md): E2M1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6}
  in blocks of 16 along the last dim, each block with an E4M3 scale, plus one FP32 scale
  per tensor, amax / (6 * 448). A block's scale is e4m3(amax_block / (6 * tensor_scale)),
  so it fits E4M3's range; elements are rounded half to even onto the E2M1 grid and
  saturate at 6. An all-zero block (or tensor) stays zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
# E2M1 magnitudes by code 0..7; an even code has mantissa bit 0
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value (ties to even), saturating at +-448, as fp32."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (ties to the even code), saturating at +-6, as fp32.

    E2M1 is a float format, so rounding is ``torch.round`` (half to even) at the spacing
    of each binade: 0.5 below 2, 1 in [2, 4), 2 from 4. In every binade the even
    multiples of the spacing are exactly the even codes (0, 1, 2 | 2, 4 | 4, 6), so
    round-half-even there is ties-to-even-code; a value just under a binade edge that
    rounds up lands on the edge, which is the next binade's first (even) code.
    (tests compare it with a nearest-grid-point search over all eight codes)"""
    x = x.float()
    a = x.abs()
    low = torch.round(a * 2) * 0.5
    mid = torch.round(a)
    high = torch.clamp(torch.round(a * 0.5) * 2, max=E2M1_MAX)
    return torch.copysign(torch.where(a < 2, low, torch.where(a < 4, mid, high)), x)


def fake_fp8(x: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """E4M3 with an FP32 scale amax / 448 per tensor (or per row, over the last dim)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True) if per_row else x.abs().amax()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return round_e4m3(x / scale) * scale


def nvfp4_scales(x: torch.Tensor, per_sample: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor scale, E4M3 block scales of shape (..., blocks)) of ``x`` (fp32). With
    ``per_sample`` the "tensor" scale is taken per index of dim 0 (activations: a sample's
    numerics then do not depend on what else is in the batch)."""
    return _scales_of_blocks(_blocks(x.float()), per_sample)


def _scales_of_blocks(blocks: torch.Tensor, per_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    block_amax = blocks.abs().amax(dim=-1)
    if per_sample:
        amax = block_amax.reshape(blocks.shape[0], -1).amax(dim=1).reshape(-1, *[1] * (blocks.ndim - 2))
    else:
        amax = block_amax.amax()
    tensor_scale = amax / (E2M1_MAX * E4M3_MAX)
    safe = torch.where(tensor_scale > 0, tensor_scale, torch.ones_like(tensor_scale))
    block_scale = round_e4m3(block_amax / (E2M1_MAX * safe))
    return tensor_scale, block_scale


def fake_nvfp4(x: torch.Tensor, per_sample: bool = False) -> torch.Tensor:
    """NVFP4 quantize-dequantize along the last dim (zero-padded to a multiple of 16)."""
    shape, n = x.shape, x.shape[-1]
    blocks = _blocks(x.float())
    tensor_scale, block_scale = _scales_of_blocks(blocks, per_sample)
    scale = (block_scale * tensor_scale).unsqueeze(-1)  # (..., blocks, 1)
    # a zero scale (an all-zero block, or one flushed below E4M3's smallest subnormal)
    # divides by 1 instead and multiplies back by 0
    q = round_e2m1(blocks / torch.where(scale > 0, scale, torch.ones_like(scale))) * scale
    return q.reshape(*shape[:-1], -1)[..., :n]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    pad = (-x.shape[-1]) % NVFP4_BLOCK
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
