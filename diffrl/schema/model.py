"""The model section: the family, its weights and their LoRA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffrl.schema.fields import _f


@dataclass
class LoraConfig:
    rank: int = _f(32, "LoRA rank r.", valid=">= 1")
    alpha: float = _f(64.0, "LoRA alpha; the update is scaled by alpha / rank.", valid="> 0")
    dropout: float = _f(0.0, "LoRA dropout. Keep 0 for exact on-policy replay.", valid="in [0, 1)")
    target_modules: list[str] | None = _f(None, "Module names to adapt; null uses the family default.")


@dataclass
class ModelConfig:
    family: str = _f(
        "flux",
        "Adapter family: one of diffrl.models.available() (flux, flux_kontext, flux2, qwenimage, "
        "sd3, sana, wan, wan22, toy).",
    )
    pretrained: str = _f(
        "tiny",
        "Hub id or local diffusers directory, 'tiny' for the offline tiny twin, or (family toy) "
        "'shapeworld' for the shipped pretrained ShapeWorld model.",
    )
    revision: str | None = _f(None, "Hub revision (branch, tag or commit) when `pretrained` is a hub id.")
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "Dtype of the frozen weights (transformer, VAE, text encoders). LoRA weights stay fp32."
    )
    height: int = _f(64, "Image height in pixels.", valid=">= 16")
    width: int = _f(64, "Image width in pixels.", valid=">= 16")
    num_frames: int = _f(1, "Frames per sample (video families only).", valid=">= 1")
    guidance_scale: float = _f(1.0, "CFG scale (sd3/sana/wan) or guidance embedding value (flux).")
    truncate_timestep: bool = _f(
        False,
        "flux: give the transformer int(1000 sigma) / 1000 for the timestep, as DanceGRPO's and BranchGRPO's "
        "scripts do; false: 1000 sigma cast to the weights' dtype, then / 1000, as FluxPipeline does.",
    )
    guidance_scale_2: float | None = _f(
        None,
        "wan22: CFG scale of the low-noise expert (Wan2.2 A14B: 3.0, and 4.0 on the high-noise "
        "one); null: guidance_scale.",
    )
    max_sequence_length: int = _f(
        128, "Max text tokens for the long text encoder (T5/Gemma/UMT5).", valid=">= 1"
    )
    full_finetune: bool = _f(
        False, "Train all transformer weights instead of LoRA; keeps a frozen reference copy."
    )
    lora: LoraConfig = _f(LoraConfig(), "LoRA settings (ignored when full_finetune).")
    init_lora: str | None = _f(
        None,
        "Start the LoRA from trained weights instead of zero: a folder or file in diffusers format "
        "(pytorch_lora_weights.safetensors, a diffrl export) or PEFT's (adapter_config.json, as flow_grpo "
        "releases), or a hub id; its rank and alpha must be model.lora's. A resume loads the checkpoint.",
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    tiny_seed: int = _f(0, "Seed for the random weights of the tiny twin.")
