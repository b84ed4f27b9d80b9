"""Low-precision exploration copies (Sol-RL): reference quantizers exact to the formats."""

from diffrl.quant.formats import fake_fp8, fake_nvfp4, nvfp4_scales, round_e2m1, round_e4m3

__all__ = ["fake_fp8", "fake_nvfp4", "nvfp4_scales", "round_e2m1", "round_e4m3"]
