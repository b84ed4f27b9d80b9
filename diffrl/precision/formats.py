"""Reference (fake) quantizers, exact to the formats: NVFP4 and FP8 E4M3.

They return dequantized fp32 tensors (quantize, then dequantize) so that a model can run
with low-precision numerics on any device, including CPU in CI.

* **FP8 E4M3** (OCP "e4m3fn": 4 exponent bits, bias 7, 3 mantissa bits, no infinities,
  max 448, subnormals down to 2^-9). Values are scaled by amax / 448 per tensor or per
  row, rounded to nearest with ties to even (torch's ``float8_e4m3fn`` cast), and
  saturated at +-448. The scaled value x * 448 / amax is computed in fp64, where it is
  exact whenever the true quotient is an E4M3 tie (x * 448 needs at most 27 bits), so
  ties round to even as the format says: x = -2.90625 at amax 3.875 is exactly -336 and
  becomes code 320. modelopt's fake-quantization path (``tensor_quant.fp8_eager``,
  x * (448 / amax)) rounds that tie the same way; its export path, x / (amax / 448) in
  fp32, sees -336.00003 and gives 352.
* **NVFP4** (NVIDIA's 4-bit float; docs/ALGORITHMS.md section 9): E2M1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6}
  in blocks of 16 along the last dim, each block with an E4M3 scale, plus one FP32 scale
  per tensor, amax / (6 * 448). A block's scale is e4m3(amax_block / (6 * tensor_scale)),
  clamped to [2^-9, 448] before the cast as modelopt's ``NVFP4QTensor`` does (and so real
  NVFP4 checkpoints): a tiny block next to a huge one keeps E4M3's smallest subnormal
  scale instead of being flushed to zero. A block whose amax is 0 gets scale 1 (modelopt
  too). Elements are rounded half to even onto the E2M1 grid and saturate at 6. An
  all-zero tensor stays zero (modelopt returns NaN there: 0 / 0 in its block scale).

Reference: nvidia-modelopt 0.47.0, ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``
(``get_weights_scaling_factor(_2)``, ``quantize``) and ``tensor_quant.py``; tests compare
with its outputs (``tests/fixtures/reference/modelopt.json``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
# E2M1 magnitudes by code 0..7; an even code has mantissa bit 0
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


E4M3_MIN_SUBNORMAL = 2.0**-9


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value (ties to even), saturating at +-448, as fp32 (fp64 in stays
    fp64 up to the cast, so an exact tie is not moved by an fp32 rounding first)."""
    x = x if x.dtype == torch.float64 else x.float()
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


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
    amax = torch.where(amax > 0, amax, torch.full_like(amax, E4M3_MAX)).double()
    # x * 448 is exact in fp64 and the division rounds once, so exact ties stay exact
    codes = round_e4m3(x.double() * E4M3_MAX / amax)
    return (codes.double() * amax / E4M3_MAX).float()


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
    block_scale = block_amax / (E2M1_MAX * safe)
    # modelopt: a zero scale becomes 1, and the rest is clamped to E4M3's range before
    # the cast, so a tiny block keeps the smallest subnormal scale 2^-9 instead of 0
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    return tensor_scale, round_e4m3(block_scale.clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX))


def fake_nvfp4(x: torch.Tensor, per_sample: bool = False) -> torch.Tensor:
    """NVFP4 quantize-dequantize along the last dim (zero-padded to a multiple of 16)."""
    shape, n = x.shape, x.shape[-1]
    blocks = _blocks(x.float())
    tensor_scale, block_scale = _scales_of_blocks(blocks, per_sample)
    scale = (block_scale * tensor_scale).unsqueeze(-1)  # (..., blocks, 1)
    # a zero scale (only an all-zero tensor's: tensor scale 0) divides by 1 instead and
    # multiplies back by 0
    q = round_e2m1(blocks / torch.where(scale > 0, scale, torch.ones_like(scale))) * scale
    return q.reshape(*shape[:-1], -1)[..., :n]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    pad = (-x.shape[-1]) % NVFP4_BLOCK
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)


# -- FP8 training casts (the unified precision flow, diffrl/precision/fp8_flow.py) -----------
# float8 dtype and its largest finite value; E5M2 is the gradients' format in torchao's
# tensor-wise recipe (more range, one mantissa bit less)
FP8_DTYPES = {"e4m3": (torch.float8_e4m3fn, E4M3_MAX), "e5m2": (torch.float8_e5m2, 57344.0)}
# torchao's floor on amax before the scale is taken (float8_utils.EPS)
FP8_AMAX_EPS = 1e-12


def fp8_codes(x: torch.Tensor, rowwise: bool, fmt: str = "e4m3", pow2: bool = False):
    """(float8 codes, fp32 scale) of ``x`` as torchao's float8 training casts it
    (``hp_tensor_to_float8_dynamic``): scale = max / amax in fp32 (amax floored at 1e-12),
    one per row over the last dim (``rowwise``, torchao's axiswise) or one per tensor;
    with ``pow2`` rounded down to a power of two (torchao's rowwise recipe,
    ``round_scales_to_power_of_2``); x * scale saturates at +-max and is cast. The value
    is ``codes.float() / scale``.

    Reference: torchao 0.18 ``float8/float8_utils.py`` (``amax_to_scale``,
    ``to_fp8_saturated``); tests compare a linear through it with torchao's own
    ``matmul_with_hp_or_float8_args`` on the CPU."""
    dtype, fmax = FP8_DTYPES[fmt]
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = (fmax / amax.double().clamp(min=FP8_AMAX_EPS)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (x * scale).clamp(-fmax, fmax).to(dtype), scale


def fake_fp8_cast(x: torch.Tensor, rowwise: bool, fmt: str = "e4m3", pow2: bool = False) -> torch.Tensor:
    """FP8 quantize-dequantize as :func:`fp8_codes` casts it, as fp32."""
    codes, scale = fp8_codes(x, rowwise, fmt, pow2)
    return codes.float() / scale


# DeepSeek-V3's fine-grained FP8 (arXiv 2412.19437, section 3.3.2), Jet-RL's granularity and
# torchao's prototype ``blockwise_fp8_training``: activations and gradients scaled per 1x128
# tile of a row (along the GEMM's reduction dim), weights per 128x128 tile
FP8_TILE = 128


def fp8_tile_codes(x: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes, fp32 scale broadcast to ``x``'s shape) of a 2-D ``x`` cast with one
    scale per ``tile`` (rows, columns): scale = 448 / amax of the tile (amax in fp64,
    floored at 1e-12, the scale rounded to fp32), x * scale saturated and cast, as
    torchao's ``torch_blockwise_scale_act_quant_lhs`` (1 x 128) and
    ``torch_blockwise_scale_weight_quant`` (128 x 128) compute it (torchao 0.18
    ``prototype/blockwise_fp8_training/kernels.py``; tests compare with both). Edge tiles
    of a dimension that is not a multiple of the tile take the amax of what they hold
    (torchao asks for multiples). The value is ``codes.float() / scale``."""
    dtype, fmax = FP8_DTYPES["e4m3"]
    x = x.float()
    (rows, cols), (tr, tc) = x.shape, tile
    padded = F.pad(x, (0, (-cols) % tc, 0, (-rows) % tr))
    pr, pc = padded.shape
    # one row per tile (torchao's layout: tiles of the row-major tensor, then their amax)
    tiles = padded.reshape(pr // tr, tr, pc // tc, tc).permute(0, 2, 1, 3).reshape(-1, tr * tc)
    amax = tiles.abs().amax(dim=1).double().clamp(min=FP8_AMAX_EPS)
    per_tile = (fmax / amax).float().reshape(pr // tr, pc // tc)
    scale = per_tile.repeat_interleave(tr, dim=0).repeat_interleave(tc, dim=1)[:rows, :cols]
    return (x * scale).clamp(-fmax, fmax).to(dtype), scale
