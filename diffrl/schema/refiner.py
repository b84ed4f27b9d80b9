"""The ``refiner`` section: PromptRL's prompt-refining language model, trained with GRPO
inside the flow model's RL loop (docs/ALGORITHMS.md, "PromptRL"; G-U-N/UniRL@53c28c9)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffrl.schema.fields import _f


@dataclass
class RefinerConfig:
    model: str | None = _f(
        None,
        "The refiner's causal LM: a hub id (PromptRL: Qwen/Qwen2.5-VL-3B-Instruct) or local folder, 'tiny' "
        "(a random tiny twin), 'shapeworld' (the shipped ShapeWorld refiner, assets/toy_refiner); null: "
        "no refiner, the flow model renders the prompts as they are.",
    )
    revision: str | None = _f(None, "Hub revision of `model`.")
    dtype: Literal["float32", "bfloat16", "float16"] = _f("float32", "Dtype of the LM's frozen weights.")
    lora_rank: int = _f(
        16,
        "LoRA rank of the refiner (peft); 0 fine-tunes every weight as UniRL does, with a frozen copy "
        "as the KL reference.",
        valid=">= 0",
    )
    lora_alpha: float = _f(32.0, "LoRA alpha of the refiner.", valid="> 0")
    lr: float = _f(1.0e-6, "The refiner's learning rate (UniRL's LLM rate: 1e-6).", valid="> 0")
    train: bool = _f(True, "Train the refiner (false: a fixed rewriter in front of the flow model's RL).")
    train_flow: bool = _f(
        True, "Train the flow model too (UniRL's JOINT=true); false trains the refiner alone (JOINT=false)."
    )
    kl_coef: float = _f(
        0.01, "k3 KL of the refiner to its initial weights, per token (UniRL: 0.01).", valid=">= 0"
    )
    clip_range: float = _f(
        0.2,
        "PPO clip of the refiner's token ratio; with one update per iteration the ratio is 1 and it never "
        "binds (UniRL's on-policy gradient).",
        valid="> 0",
    )
    template: Literal["promptrl", "plain"] = _f(
        "promptrl",
        "How a prompt is put to the LM: 'promptrl' (its chat template, PromptRL's instruction, the rewrite "
        "between <answer> tags) or 'plain' (the prompt, then the rewrite: the ShapeWorld refiner).",
    )
    format_reward: float = _f(
        1.0,
        "Added to the reward of a rewrite that answers in <answer> tags (UniRL: 1, a plain sum); the "
        "plain template has no format.",
        valid=">= 0",
    )
    max_new_tokens: int = _f(512, "Longest rewrite sampled (UniRL: 512 in training).", valid=">= 1")
    temperature: float = _f(
        1.0, "Sampling temperature of the rewrites in training (UniRL: 1.0).", valid="> 0"
    )
    keep_original: int = _f(
        0,
        "Members of each group rendered from the original prompt, untouched (UniRL's editing runs: 2 of 8); "
        "their reward takes part in the group's advantages, and they train the flow model only.",
        valid=">= 0",
    )
    eval_without: bool = _f(
        True,
        "Also evaluate without the refiner (eval_plain/..., eval_para_plain/...), beside the refined "
        "evaluation (eval/..., greedy rewrites as UniRL evaluates).",
    )
