"""Speed and precision: compilation and attention, Sol-RL's low-precision pool, the FP8 flow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffrl.schema.fields import _f


@dataclass
class PerfConfig:
    compile_rollout: bool = _f(
        False,
        "torch.compile the transformer the rollouts call (policy and reference-backend exploration copy; the "
        "torchao copy is always compiled by block). On in the real-model configs; docs/BENCHMARKS.md.",
    )
    compile_scope: Literal["blocks", "whole"] = _f(
        "blocks",
        "What compile_rollout compiles: each repeated transformer block once, reused by every block of "
        "its class (regional compilation: compile time independent of depth; the training forward stays "
        "eager), or the whole model as one graph.",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = _f(
        "default", "torch.compile mode; reduce-overhead adds CUDA graphs (static shapes only, CUDA only)."
    )
    exact_replay: bool = _f(
        True,
        "Compiled rollouts round every intermediate to the autocast / weights' dtype where eager code "
        "would (inductor's emulate_precision_casts), so the eager training forward replays them: replay "
        "gap below 1e-6 under bf16 / fp16, 0 for the unified FP8 flow (docs/TRAINING.md, 'On-policy'). "
        "false: inductor's faster fusion, 1e-5 to 1e-3 off-policy.",
    )
    attention_backend: str | None = _f(
        None,
        "diffusers attention backend for the run (flash, _flash_3, _native_flash, _native_cudnn, xformers, "
        "sage); null keeps diffusers' default, PyTorch SDPA. Kernel-download (*_hub) backends are refused.",
    )


@dataclass
class SolRLConfig:
    enabled: bool = _f(
        False,
        "Sol-RL two-stage rollouts: explore a pool in low precision, select a contrastive subset, "
        "regenerate it in BF16 from the same noise and train only on the regenerated samples.",
    )
    pool_size: int = _f(
        16,
        "Candidates explored per prompt (a tree pool's leaf count); rollout.group_size of them are "
        "regenerated and trained.",
        valid=">= 1",
    )
    precision: Literal["auto", "nvfp4", "fp8", "bf16"] = _f(
        "auto",
        "Exploration precision. auto follows the hardware: nvfp4 where FP4 GEMMs run (Blackwell, torchao), "
        "fp8 where FP8 GEMMs run (Ada, Hopper), else fp8 numerics through the reference quantizer (no "
        "speed-up). bf16 explores with the policy itself (the control).",
    )
    backend: Literal["auto", "reference", "modelopt", "torchao"] = _f(
        "auto", "Quantization backend; auto picks what the hardware really runs and logs it."
    )
    keep_high: list[str] | None = _f(
        None, "Anchored regexes of layers kept in high precision; null uses the family list."
    )
    min_quantized_dim: int = _f(
        0,
        "Layers whose larger dimension is at most this stay in high precision too (Sol-RL's nvfp4_min_dim: "
        "2240 for SANA, 2432 for SD3, 1000 for FLUX); 0: none.",
        valid=">= 0",
    )
    select: Literal["best_worst", "max_variance", "random"] = _f(
        "best_worst",
        "Subset rule per prompt: top and bottom by reward, the subset of largest reward variance, or "
        "uniformly random (the ablation control).",
    )
    explore: Literal["replay", "ode"] = _f(
        "replay",
        "replay: the pool uses the training sampler (independent or tree) and stage 2 replays its initial, "
        "per-step and branch noise; ode: Sol-RL's recipe, a deterministic ODE pool with explore_num_steps "
        "steps whose initial noise alone is replayed.",
    )
    explore_num_steps: int | None = _f(
        None,
        "Denoising steps of an ode pool (Sol-RL: 6, against 10 for training); null uses sampling.num_steps.",
        valid=">= 1",
    )


@dataclass
class PrecisionConfig:
    rollout: Literal["bf16", "fp8"] = _f(
        "bf16",
        "Precision of the policy's rollouts. fp8 runs its linear layers through an FP8 quantizer while "
        "sampling (in place, no copy); with train bf16 that is the naive split (FP8 samples, a BF16 update).",
    )
    train: Literal["bf16", "fp8"] = _f(
        "bf16",
        "Precision of the update's forwards. fp8 with rollout fp8 is Jet-RL's unified flow: the same "
        "quantizer samples and trains (straight-through gradients, fp32 master weights), so replays are "
        "on-policy. Needs rollout fp8; not combined with solrl.",
    )
    backend: Literal["auto", "reference", "torchao"] = _f(
        "auto",
        "reference: pure-PyTorch casts (any device, no speed-up); torchao: its float8 training GEMM (real "
        "FP8 on Ada / Hopper); auto picks torchao where FP8 GEMMs run and it is installed.",
    )
    scaling: Literal["rowwise", "tensorwise", "blockwise"] = _f(
        "rowwise",
        "rowwise: a scale per token and per weight row (torchao's recipe; batch-independent, exact replay); "
        "tensorwise: a scale per tensor (faster, but a sample's numerics depend on its batch); blockwise: "
        "DeepSeek-V3 / Jet-RL tiles, 1x128 activations and gradients, 128x128 weights (batch-independent; "
        "torchao's prototype kernels on Hopper, the reference casts elsewhere).",
    )
    keep_high: list[str] | None = _f(
        None, "Anchored regexes of layers kept in high precision; null uses the family list (as solrl's)."
    )
