"""How rollouts sample: the step rule and its schedule, the rollout batch, BranchGRPO's trees."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffrl.schema.fields import _f


@dataclass
class SamplingConfig:
    num_steps: int = _f(10, "Denoising steps per rollout.", valid=">= 1")
    sde_type: Literal["sde", "cps", "dance", "consistency", "ode"] = _f(
        "sde",
        "Step rule: flow-GRPO 'sde', coefficient-preserving 'cps', DanceGRPO 'dance' (constant eta), "
        "'consistency' (few-step models, RLCM: predict the clean sample, re-noise it to the next sigma with "
        "fresh noise; evaluations sample the same way), 'ode'.",
    )
    noise_level: float = _f(
        0.7,
        "Noise scale: a for sde/cps, eta for dance (consistency re-noises fully and ignores it).",
        valid=">= 0",
    )
    eval_num_steps: int | None = _f(
        None,
        "Steps for evaluation (ODE; consistency sampling under sde_type consistency); null uses num_steps.",
        valid=">= 1",
    )
    ode_solver: Literal["euler", "dpm2"] = _f(
        "euler",
        "The deterministic rollouts' solver: Euler, or DPM-Solver++(2M) (DiffusionNFT's dpm2; needs "
        "sde_type ode and independent rollouts). Evaluations take Euler steps either way, as DiffusionNFT's.",
    )
    sigma_shift: float | None = _f(
        None,
        "A fixed time shift s t / (1 + (s - 1) t) over linspace(1, 0, N + 1) in place of the pipeline's "
        "sigma grid (DanceGRPO and BranchGRPO: 3); null: the pipeline scheduler's own grid.",
        valid="> 0",
    )
    sde_window: list[int] | None = _f(
        None, "[start, end) step indices that use the SDE; other steps use the ODE. Null: all steps."
    )
    sde_window_slide_every: int = _f(
        0,
        "Move the SDE window later every N iterations (MixGRPO sliding window); 0 keeps it fixed.",
        valid=">= 0",
    )
    sde_window_slide_stride: int = _f(
        1, "Steps the SDE window moves per slide; it stops at the last step.", valid=">= 1"
    )
    sde_window_range: list[int] | None = _f(
        None,
        "[lo, hi]: each iteration places the SDE window (its size from sde_window) at a random start in "
        "lo .. hi - size (Flow-GRPO-Fast's sde_window_range); null keeps the window where sde_window says.",
    )


@dataclass
class RolloutConfig:
    strategy: str = _f("independent", "Rollout strategy name from diffrl.sampling.available_strategies().")
    prompts_per_step: int = _f(2, "Distinct prompts per iteration (across all processes).", valid=">= 1")
    group_size: int = _f(4, "Samples per prompt (the GRPO group).", valid=">= 2")
    batch_size: int = _f(8, "Samples per transformer forward during rollouts, per process.", valid=">= 1")
    same_noise: bool = _f(
        False,
        "Every sample of a group starts from the same initial noise and differs only by its SDE noise "
        "(DanceGRPO's init_same_noise, flow_grpo's sample.same_latent); evaluations keep one noise per seed.",
    )


@dataclass
class TreeConfig:
    split_steps: list[int] = _f([0, 3, 6, 9], "Denoising steps at which every node branches (BranchGRPO).")
    branch_factors: list[int] = _f([2], "Children per split: one per split step, or one value for all.")
    split_noise_scale: float = _f(
        1.0, "Noise scale at split steps; tree.split_noise says what it multiplies.", valid=">= 0"
    )
    split_noise: Literal["level", "draw"] = _f(
        "level",
        "'level': multiply the step rule's noise level (drift and log-prob use the scaled std, a proper "
        "SDE step); 'draw': multiply only the drawn noise, as BranchGRPO's reference code does.",
    )
    reward_fusion: Literal["mean", "prob_weighted"] = _f(
        "mean", "Internal node reward: mean of its leaves, or softmax(child log-prob / T)-weighted mean."
    )
    fusion_temperature: float = _f(1.0, "Temperature T of the prob_weighted fusion softmax.", valid="> 0")
    width_pruning: Literal["none", "best_worst", "best_per_branch", "chain_prefix", "batch_best_worst"] = _f(
        "none",
        "After the last split, train only the best+worst leaves per tree, or the best of each sibling set; "
        "chain_prefix / batch_best_worst are the BranchGRPO reference's modes 1 / 2 (docs/ALGORITHMS.md).",
    )
    width_keep_fraction: float = _f(
        0.5,
        "Fraction of leaves (per tree, or per sibling set) whose edges are trained; for chain_prefix of each "
        "chain's post-split edges, for batch_best_worst of the batch's post-split edges.",
        valid="in (0, 1]",
    )
    depth_pruning: list[int] = _f(
        [], "Denoising steps whose edges are not backpropagated (the rollout is unchanged)."
    )
    edges_per_step: int = _f(
        0,
        "0: an iteration's trained edges are spread over ceil(leaves / (micro_batch x accumulation)) "
        "optimizer steps; N: one optimizer step per N trained edges of a process (BranchGRPO's loop).",
        valid=">= 0",
    )
    loss_weighting: Literal["edge", "depth"] = _f(
        "edge", "Every trained edge weighs the same (BranchGRPO), or every denoising step does (independent)."
    )
    depth_pruning_slide_every: int = _f(
        0, "Move the pruned steps one step earlier every N iterations; 0 keeps them.", valid=">= 0"
    )
    depth_pruning_stop: int = _f(
        0, "The earliest step the sliding depth-pruning window may reach.", valid=">= 0"
    )
    shared_root_noise: int = _f(
        1,
        "Trees of consecutive prompts share their root noise in blocks of N (BranchGRPO's init_same_noise: "
        "the trees one GPU grows in one call, 2 in its 8-GPU recipe); 1: every tree its own.",
        valid=">= 1",
    )
