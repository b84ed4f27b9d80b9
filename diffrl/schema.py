"""The run configuration's schema: one dataclass per section, every field with its default
and a help text (``metadata["help"]``), and :class:`ConfigError`, the one error bad
configuration input raises. Loading YAML into it, overrides and the cross-field checks
are :mod:`diffrl.config`'s; each feature checks its own settings beside it
(``diffrl/sampling/checks.py``...), and each objective declares its own parameters
(``objective.args``) in its module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rewards.errors import UserError


class ConfigError(UserError, ValueError):
    """A config file or override is invalid; the message names the file, key and fix."""


def setting(default, help: str, **kw):
    """A dataclass field with a help text; mutable defaults are wrapped in a factory."""
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        proto = default
        return field(default_factory=lambda: _copy(proto), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


_f = setting  # short, for the many fields below


def _copy(value):
    import copy

    return copy.deepcopy(value)


@dataclass
class LoraConfig:
    rank: int = _f(32, "LoRA rank r.")
    alpha: float = _f(64.0, "LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = _f(0.0, "LoRA dropout. Keep 0 for exact on-policy replay.")
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
    height: int = _f(64, "Image height in pixels.")
    width: int = _f(64, "Image width in pixels.")
    num_frames: int = _f(1, "Frames per sample (video families only).")
    guidance_scale: float = _f(1.0, "CFG scale (sd3/sana/wan) or guidance embedding value (flux).")
    guidance_scale_2: float | None = _f(
        None,
        "wan22: CFG scale of the low-noise expert (Wan2.2 A14B: 3.0, and 4.0 on the high-noise "
        "one); null: guidance_scale.",
    )
    max_sequence_length: int = _f(128, "Max text tokens for the long text encoder (T5/Gemma/UMT5).")
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


@dataclass
class SamplingConfig:
    num_steps: int = _f(10, "Denoising steps per rollout.")
    sde_type: Literal["sde", "cps", "dance", "ode"] = _f(
        "sde",
        "Step rule: flow-GRPO 'sde', coefficient-preserving 'cps', DanceGRPO 'dance' (constant eta), 'ode'.",
    )
    noise_level: float = _f(0.7, "Noise scale: a for sde/cps, eta for dance.")
    eval_num_steps: int | None = _f(None, "Steps for evaluation (ODE); null uses num_steps.")
    ode_solver: Literal["euler", "dpm2"] = _f(
        "euler",
        "The deterministic rollouts' solver: Euler, or DPM-Solver++(2M) (DiffusionNFT's dpm2; needs "
        "sde_type ode and independent rollouts). Evaluations take Euler steps either way, as DiffusionNFT's.",
    )
    sigma_shift: float | None = _f(
        None,
        "A fixed time shift s t / (1 + (s - 1) t) over linspace(1, 0, N + 1) in place of the pipeline's "
        "sigma grid (DanceGRPO and BranchGRPO: 3); null: the pipeline scheduler's own grid.",
    )
    sde_window: list[int] | None = _f(
        None, "[start, end) step indices that use the SDE; other steps use the ODE. Null: all steps."
    )
    sde_window_slide_every: int = _f(
        0, "Move the SDE window later every N iterations (MixGRPO sliding window); 0 keeps it fixed."
    )
    sde_window_slide_stride: int = _f(1, "Steps the SDE window moves per slide; it stops at the last step.")
    sde_window_range: list[int] | None = _f(
        None,
        "[lo, hi]: each iteration places the SDE window (its size from sde_window) at a random start in "
        "lo .. hi - size (Flow-GRPO-Fast's sde_window_range); null keeps the window where sde_window says.",
    )


@dataclass
class RolloutConfig:
    strategy: str = _f("independent", "Rollout strategy name from diffrl.sampling.available_strategies().")
    prompts_per_step: int = _f(2, "Distinct prompts per iteration (across all processes).")
    group_size: int = _f(4, "Samples per prompt (the GRPO group).")
    batch_size: int = _f(8, "Samples per transformer forward during rollouts, per process.")
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
        1.0, "Noise scale at split steps; tree.split_noise says what it multiplies."
    )
    split_noise: Literal["level", "draw"] = _f(
        "level",
        "'level': multiply the step rule's noise level (drift and log-prob use the scaled std, a proper "
        "SDE step); 'draw': multiply only the drawn noise, as BranchGRPO's reference code does.",
    )
    reward_fusion: Literal["mean", "prob_weighted"] = _f(
        "mean", "Internal node reward: mean of its leaves, or softmax(child log-prob / T)-weighted mean."
    )
    fusion_temperature: float = _f(1.0, "Temperature T of the prob_weighted fusion softmax.")
    width_pruning: Literal["none", "best_worst", "best_per_branch", "chain_prefix", "batch_best_worst"] = _f(
        "none",
        "After the last split, train only the best+worst leaves per tree, or the best of each sibling set; "
        "chain_prefix / batch_best_worst are the BranchGRPO reference's modes 1 / 2 (docs/ALGORITHMS.md).",
    )
    width_keep_fraction: float = _f(
        0.5,
        "Fraction of leaves (per tree, or per sibling set) whose edges are trained; for chain_prefix of each "
        "chain's post-split edges, for batch_best_worst of the batch's post-split edges.",
    )
    depth_pruning: list[int] = _f(
        [], "Denoising steps whose edges are not backpropagated (the rollout is unchanged)."
    )
    edges_per_step: int = _f(
        0,
        "0: an iteration's trained edges are spread over ceil(leaves / (micro_batch x accumulation)) "
        "optimizer steps; N: one optimizer step per N trained edges of a process (BranchGRPO's loop).",
    )
    loss_weighting: Literal["edge", "depth"] = _f(
        "edge", "Every trained edge weighs the same (BranchGRPO), or every denoising step does (independent)."
    )
    depth_pruning_slide_every: int = _f(
        0, "Move the pruned steps one step earlier every N iterations; 0 keeps them."
    )
    depth_pruning_stop: int = _f(0, "The earliest step the sliding depth-pruning window may reach.")


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
    scaling: Literal["rowwise", "tensorwise"] = _f(
        "rowwise",
        "torchao's recipe: rowwise (a scale per token and per weight row, batch-independent, exact replay) "
        "or tensorwise (a scale per tensor: faster, but a sample's numerics depend on its batch).",
    )
    keep_high: list[str] | None = _f(
        None, "Anchored regexes of layers kept in high precision; null uses the family list (as solrl's)."
    )


@dataclass
class DataConfig:
    train_prompts: str = _f(
        "assets/prompts/tiny_train.txt",
        "Training prompts: a prompt set name (diffrl-data list: pickscore/train, geneval/train...) or a "
        "file (.txt one per line, .jsonl with 'prompt', .csv with 'Prompts', .json list).",
    )
    eval_prompts: str = _f(
        "assets/prompts/tiny_eval.txt", "Held-out prompts for evaluation: a set name or a file."
    )
    allow_toy_prompts: bool = _f(
        False,
        "Let a real model (not a tiny twin, the ShapeWorld toys or random:<arch>) train or evaluate on "
        "the shipped toy prompt files under assets/; refused otherwise: 9 toy prompts make no experiment.",
    )


@dataclass
class RewardSpec:
    name: str = _f("jpeg_compressibility", "Registered reward name (see rewards.available()).")
    weight: float = _f(1.0, "Weight of this reward in the combined score.")
    args: dict = _f({}, "Keyword arguments for the reward's constructor (e.g. weights path).")
    label: str = _f(
        "",
        "The entry's name in logs and scores (default: name); needed when a reward is used twice, "
        "e.g. two `remote` servers.",
    )

    @property
    def key(self) -> str:
        return self.label or self.name


@dataclass
class AdvantageConfig:
    estimator: Literal["group", "global_std", "median", "decoupled"] = _f(
        "group", "group mean/std, group mean with global std, median-centred (MC-GRPO), or per-reward (GDPO)."
    )
    eps: float = _f(1e-4, "Added to the std before dividing (DanceGRPO / BranchGRPO: 1e-8).")
    std: Literal["population", "sample"] = _f(
        "population",
        "Std convention: 'population' (ddof 0, flow_grpo) or 'sample' (ddof 1, torch.std, as "
        "DanceGRPO and BranchGRPO; with eps 1e-8 it is their normalisation).",
    )
    filter_zero_std: bool = _f(True, "Drop groups whose rewards are all equal; they carry no signal.")
    drop_zero: bool = _f(
        False,
        "Independent rollouts: every sample whose advantage is exactly 0 leaves the update, the rest are "
        "laid out evenly over the same micro-batches, and a keyed few zero-advantage samples come back to "
        "fill them evenly (flow_grpo's train_sd3.py); false: such samples stay in place with weight 0.",
    )


@dataclass
class ObjectiveConfig:
    name: str = _f("flow_grpo", "Objective name from diffrl.algorithms.available_objectives().")
    clip_range: float = _f(1e-4, "PPO ratio clip epsilon.")
    adv_clip_max: float = _f(5.0, "Advantages are clipped to [-adv_clip_max, adv_clip_max].")
    timestep_fraction: float = _f(1.0, "Fraction of trainable denoising steps used per sample.")
    skip_last_step: bool = _f(
        False,
        "Never train the last denoising step (DanceGRPO's and BranchGRPO's ignore_last): it is still "
        "sampled, but its Gaussian is the narrowest and its log-prob the least stable.",
    )
    timestep_selection: Literal["random", "first"] = _f(
        "random",
        "Which timestep_fraction of the steps: a random subset per micro-batch (DanceGRPO, DiffusionNFT), or "
        "the first ones (flow_grpo's train_sd3.py: 0.99 of 10 steps trains steps 0-8, never the last).",
    )
    kl_coef: float = _f(0.0, "Weight of the KL to the reference policy.")
    kl_type: Literal["exact", "flow_grpo"] = _f(
        "exact",
        "'exact' Gaussian KL ||mu-mu_ref||^2/(2 std^2), std^2 = std_t^2 (-dt); 'flow_grpo' "
        "divides by 2 std_t^2 instead.",
    )
    logprob_reduction: Literal["mean", "sum", "flow_grpo"] = _f(
        "mean",
        "Reduce the per-element Gaussian log-density over latent dims by mean (flow_grpo) or sum; "
        "'flow_grpo': flow_grpo's own log-probs (mean, except cps: -mean((x'-mu)^2) without 1/(2 std^2)).",
    )
    train_cfg: bool = _f(True, "Apply CFG when recomputing velocities for the loss (as in the rollout).")
    detach_uncond: bool = _f(
        False,
        "With train_cfg: the unconditional half of the guided velocity carries no gradient, so the update "
        "follows s * grad(v_cond) (flow_grpo's compute_log_prob); false: the whole guided velocity's.",
    )
    anchor_coef: float = _f(
        0.0,
        "Velocity anchor on the steps the objective does not train (outside the SDE window; "
        "for trees, their ODE steps): anchor_coef * mean ||v_theta - v_ref||^2 on the rollout's "
        "own states there. Keeps the untrained low-noise steps from drifting (docs/ALGORITHMS.md).",
    )
    anchor_fraction: float = _f(
        0.25,
        "Share of the untrained steps anchored per micro-batch (keyed random subset); for trees, "
        "the share of the nodes at each untrained step anchored per epoch.",
    )
    forward_window: list[int] | None = _f(
        None,
        "Clean-sample objectives (nft, awm, dgpo): the steps [start, end) whose sigma x0 is "
        "noised to; null: every step. DGPO trains the high-noise steps only.",
    )
    args: dict = _f(
        {},
        "The objective's own parameters (nft, awm: the old policy's decay and their steps; dgpo: beta; "
        "flow_dppo: kl_threshold), read into its args dataclass as rewards read theirs; "
        "`diffrl-train --help-config` lists them per objective.",
    )


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "AdamW learning rate.")
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.")
    weight_decay: float = _f(1e-4, "AdamW weight decay.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm; 0 disables.")
    scheduler: Literal["constant", "cosine", "linear"] = _f("constant", "LR schedule after warm-up.")
    warmup_steps: int = _f(0, "Linear warm-up optimizer steps.")


@dataclass
class TrainConfig:
    max_steps: int = _f(100, "Training iterations (rollout + update).")
    micro_batch_size: int = _f(4, "Samples per training forward, per process.")
    gradient_accumulation: int = _f(1, "Micro-batches per optimizer step.")
    num_inner_epochs: int = _f(1, "Passes over each iteration's samples.")
    mixed_precision: Literal["no", "bf16", "fp16"] = _f("no", "Autocast precision for forward passes.")
    ema_decay: float = _f(0.0, "EMA decay of trainable weights used for evaluation; 0 disables.")
    ema_update_every: int = _f(
        1,
        "Optimizer steps between EMA updates: the average moves after step n when (n + 1) % every == 0 "
        "(flow_grpo: 8).",
    )
    ema_warmup: bool = _f(
        False,
        "EMA decay min(ema_decay, (1 + n) / (10 + n)) after optimizer step n (flow_grpo, DiffusionNFT).",
    )
    ema_repeats: int = _f(
        1,
        "Times each EMA update is applied (flow_grpo steps its EMA once per micro-batch of samples, so each "
        "update lands once per micro-batch of an optimizer step: 2 in its 32-GPU recipes).",
    )
    max_skipped_iterations: int = _f(
        5,
        "Stop (non-zero exit) after this many iterations in a row that applied no update because of "
        "non-finite rewards or losses; 0 never stops.",
    )
    collective_timeout_minutes: float = _f(
        60.0,
        "How long a collective may wait before the process group gives up (torch's default is 10 "
        "minutes, less than a first compile or a 12B checkpoint write can take on another process).",
    )


@dataclass
class EvalConfig:
    every: int = _f(0, "Evaluate every N iterations (and at the end); 0 disables.")
    num_prompts: int = _f(
        4, "Held-out prompts used per evaluation (more than the file has: all, with a warning)."
    )
    subset: Literal["first", "spaced"] = _f(
        "first",
        "Which num_prompts: the file's first ones, or evenly spaced through it (a file sorted by category, "
        "like the HPDv2 benchmark's four styles, is then covered).",
    )
    train_num_prompts: int = _f(
        0,
        "Training prompts also evaluated (a fixed, evenly spaced subset; logged as "
        "eval_train/...); 0 skips them.",
    )
    seeds: list[int] = _f([0], "Fixed seeds; each prompt is sampled once per seed.")
    guidance_scale: float | None = _f(
        None,
        "Guidance for evaluations (CFG scale or guidance embedding; flow_grpo's sample.eval_guidance_scale); "
        "null: model.guidance_scale.",
    )
    at_start: bool = _f(False, "Also evaluate before the first update.")


@dataclass
class LoggingConfig:
    trackers: list[str] = _f(
        ["tensorboard"],
        "accelerate trackers (tensorboard, wandb, ...); [] for none. One not installed stops the start.",
    )
    project: str = _f(
        "diffrl", "W&B project (and TensorBoard's folder under logs/); the run is named run_name."
    )
    entity: str | None = _f(None, "W&B entity (team or user); null: your default.")
    tags: list[str] = _f([], "W&B tags of the run.")
    progress_bar: bool = _f(True, "Show a progress bar on the main process.")


@dataclass
class CheckpointConfig:
    every: int = _f(0, "Checkpoint every N iterations (and at the end); 0 saves only at the end.")
    keep: int = _f(3, "Keep the newest N checkpoints; 0 keeps all.")


@dataclass
class Config:
    run_name: str = _f("run", "Run name; the default output_dir is outputs/<run_name>.")
    output_dir: str | None = _f(None, "Run directory; null means outputs/<run_name>.")
    seed: int = _f(0, "Master seed: every random draw derives from it and the step.")
    model: ModelConfig = _f(ModelConfig(), "Model family and weights.")
    sampling: SamplingConfig = _f(SamplingConfig(), "SDE/ODE step settings.")
    rollout: RolloutConfig = _f(RolloutConfig(), "Rollout batch arithmetic.")
    tree: TreeConfig = _f(TreeConfig(), "Tree sampler (rollout.strategy: tree).")
    solrl: SolRLConfig = _f(SolRLConfig(), "Low-precision exploration pool, selection and BF16 regeneration.")
    precision: PrecisionConfig = _f(
        PrecisionConfig(), "FP8 rollouts and training forward from one quantizer (Jet-RL's unified flow)."
    )
    perf: PerfConfig = _f(PerfConfig(), "Speed switches measured by scripts/bench_rollout.py.")
    data: DataConfig = _f(DataConfig(), "Prompt files.")
    rewards: list[RewardSpec] = _f([RewardSpec()], "Rewards combined by weight.")
    advantage: AdvantageConfig = _f(AdvantageConfig(), "Advantage estimator.")
    objective: ObjectiveConfig = _f(ObjectiveConfig(), "Policy objective.")
    optim: OptimConfig = _f(OptimConfig(), "Optimizer.")
    train: TrainConfig = _f(TrainConfig(), "Training loop.")
    eval: EvalConfig = _f(EvalConfig(), "Held-out evaluation.")
    logging: LoggingConfig = _f(LoggingConfig(), "Metrics and trackers.")
    checkpoint: CheckpointConfig = _f(CheckpointConfig(), "Checkpointing.")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or f"outputs/{self.run_name}")
