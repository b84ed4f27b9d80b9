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
    """Nearest E2M1 value (ties to the even code), saturating at +-6, as fp32."""
    x = x.float()
    grid = E2M1_GRID.to(x.device)
    # saturate first: far above 6, fp32 distances to the grid all round to the same value
    dist = (x.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - grid).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    # at most two adjacent codes tie; prefer the even one
    parity = (torch.arange(8, device=x.device) % 2).expand_as(dist)
    code = torch.where(nearest, parity, torch.full_like(parity, 2)).argmin(dim=-1)
    return torch.sign(x) * grid[code]


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
    blocks = _blocks(x.float())
    if per_sample:
        amax = blocks.abs().reshape(blocks.shape[0], -1).amax(dim=1).reshape(-1, *[1] * (blocks.ndim - 2))
    else:
        amax = blocks.abs().amax()
    tensor_scale = amax / (E2M1_MAX * E4M3_MAX)
    safe = torch.where(tensor_scale > 0, tensor_scale, torch.ones_like(tensor_scale))
    block_scale = round_e4m3(blocks.abs().amax(dim=-1) / (E2M1_MAX * safe))
    return tensor_scale, block_scale


def fake_nvfp4(x: torch.Tensor, per_sample: bool = False) -> torch.Tensor:
    """NVFP4 quantize-dequantize along the last dim (zero-padded to a multiple of 16)."""
    shape, n = x.shape, x.shape[-1]
    tensor_scale, block_scale = nvfp4_scales(x, per_sample)
    scale = (block_scale * tensor_scale).unsqueeze(-1)  # (..., blocks, 1)
    blocks = _blocks(x.float())
    q = torch.where(scale > 0, round_e2m1(blocks / torch.where(scale > 0, scale, torch.ones_like(scale))) * scale,
                    torch.zeros_like(blocks))
    return q.reshape(*shape[:-1], -1)[..., :n]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    pad = (-x.shape[-1]) % NVFP4_BLOCK
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
