"""Low-precision exploration copies (Sol-RL): reference quantizers exact to the formats,
per-family keep-high lists, and the modelopt / torchao backends; and the unified FP8
precision flow (Jet-RL, fp8_flow.py)."""

from diffrl.precision.backends import build_exploration_copy, choose_backend, detect_hardware
from diffrl.precision.exploration import ExplorationCopy
from diffrl.precision.formats import fake_fp8, fake_nvfp4, nvfp4_scales, round_e2m1, round_e4m3
from diffrl.precision.fp8_flow import Fp8Flow, build_precision_flow
from diffrl.precision.keep_high import default_keep_high

__all__ = [
    "ExplorationCopy",
    "Fp8Flow",
    "build_precision_flow",
    "build_exploration_copy",
    "choose_backend",
    "default_keep_high",
    "detect_hardware",
    "fake_fp8",
    "fake_nvfp4",
    "nvfp4_scales",
    "round_e2m1",
    "round_e4m3",
]
