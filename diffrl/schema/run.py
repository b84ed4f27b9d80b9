"""What a run trains on and how: prompts, rewards, advantages, the objective, the optimizer, the
loop, evaluation, logging and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffrl.schema.fields import _f


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
    eval_holdout: int = _f(
        0,
        "Hold this many prompts, evenly spaced, out of data.train_prompts: training never samples them "
        "and evaluations score them (data.eval_prompts is then not read). For prompt sets with no "
        "held-out split, such as DanceGRPO's video prompts; 0: evaluate on data.eval_prompts.",
        valid=">= 0",
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
    estimator: Literal["group", "global_std", "median", "decoupled", "prompt_history"] = _f(
        "group",
        "group mean/std, group mean with global std, median-centred (MC-GRPO), per-reward (GDPO), or each "
        "prompt's rewards over this and earlier iterations (DDPO's and RLCM's per-prompt stat tracking; "
        "independent rollouts).",
    )
    history_size: int = _f(
        32,
        "prompt_history: the last N rewards of each prompt kept (RLCM: stat_buffer_size 32).",
        valid=">= 1",
    )
    history_min_count: int = _f(
        16,
        "prompt_history: below this many rewards a prompt is normalised by the whole batch (RLCM: "
        "stat_min_count 16).",
        valid=">= 1",
    )
    eps: float = _f(1e-4, "Added to the std before dividing (DanceGRPO / BranchGRPO: 1e-8).", valid=">= 0")
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
    clip_range: float = _f(1e-4, "PPO ratio clip epsilon.", valid="> 0")
    adv_clip_max: float = _f(5.0, "Advantages are clipped to [-adv_clip_max, adv_clip_max].", valid="> 0")
    timestep_fraction: float = _f(
        1.0, "Fraction of trainable denoising steps used per sample.", valid="in (0, 1]"
    )
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
    kl_coef: float = _f(0.0, "Weight of the KL to the reference policy.", valid=">= 0")
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
        valid=">= 0",
    )
    anchor_fraction: float = _f(
        0.25,
        "Share of the untrained steps anchored per micro-batch (keyed random subset); for trees, "
        "the share of the nodes at each untrained step anchored per epoch.",
        valid="in (0, 1]",
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
    lr: float = _f(3e-4, "AdamW learning rate (0: a control run that never moves).", valid=">= 0")
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.")
    weight_decay: float = _f(1e-4, "AdamW weight decay.", valid=">= 0")
    eps: float = _f(1e-8, "AdamW epsilon.", valid="> 0")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm; 0 disables.", valid=">= 0")
    scheduler: Literal["constant", "cosine", "linear"] = _f("constant", "LR schedule after warm-up.")
    warmup_steps: int = _f(0, "Linear warm-up optimizer steps.", valid=">= 0")


@dataclass
class TrainConfig:
    max_steps: int = _f(100, "Training iterations (rollout + update).", valid=">= 0")
    micro_batch_size: int = _f(4, "Samples per training forward, per process.", valid=">= 1")
    gradient_accumulation: int = _f(1, "Micro-batches per optimizer step.", valid=">= 1")
    num_inner_epochs: int = _f(1, "Passes over each iteration's samples.", valid=">= 1")
    shuffle_samples: bool = _f(
        True,
        "Train an iteration's samples in a keyed random order (flow_grpo, DiffusionNFT); false: in "
        "rollout order (DanceGRPO's train_grpo_flux.py).",
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = _f("no", "Autocast precision for forward passes.")
    ema_decay: float = _f(
        0.0, "EMA decay of trainable weights used for evaluation; 0 disables.", valid="in [0, 1)"
    )
    ema_update_every: int = _f(
        1,
        "Optimizer steps between EMA updates: the average moves after step n when (n + 1) % every == 0 "
        "(flow_grpo: 8).",
        valid=">= 1",
    )
    ema_warmup: bool = _f(
        False,
        "EMA decay min(ema_decay, (1 + n) / (10 + n)) after optimizer step n (flow_grpo, DiffusionNFT).",
    )
    ema_repeats: int = _f(
        1,
        "Times each EMA update is applied (flow_grpo steps its EMA once per micro-batch of samples, so each "
        "update lands once per micro-batch of an optimizer step: 2 in its 32-GPU recipes).",
        valid=">= 1",
    )
    replay_gap_warn: float = _f(
        1e-6,
        "Warn when replay/logprob_gap (the training forward against the log-prob stored at sampling) "
        "passes this; exact runs log at most ~1e-7, off-policy ones 1e-5 and more. 0: never.",
        valid=">= 0",
    )
    max_skipped_iterations: int = _f(
        5,
        "Stop (non-zero exit) after this many iterations in a row that applied no update because of "
        "non-finite rewards or losses; 0 never stops.",
        valid=">= 0",
    )
    collective_timeout_minutes: float = _f(
        60.0,
        "How long a collective may wait before the process group gives up (torch's default is 10 "
        "minutes, less than a first compile or a 12B checkpoint write can take on another process).",
        valid="> 0",
    )


@dataclass
class EvalConfig:
    every: int = _f(0, "Evaluate every N iterations (and at the end); 0 disables.", valid=">= 0")
    num_prompts: int = _f(
        4, "Held-out prompts used per evaluation (more than the file has: all, with a warning).", valid=">= 1"
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
        valid=">= 0",
    )
    seeds: list[int] = _f([0], "Fixed seeds; each prompt is sampled once per seed.")
    guidance_scale: float | None = _f(
        None,
        "Guidance for evaluations (CFG scale or guidance embedding; flow_grpo's sample.eval_guidance_scale); "
        "null: model.guidance_scale.",
    )
    at_start: bool = _f(False, "Also evaluate before the first update.")
    paraphrases: str | None = _f(
        None,
        "A paraphrase file (.jsonl: prompt, original; docs/DATA.md) also evaluated: each paraphrase and its "
        "original from the same noise, the images judged against the original, logged as eval_para/... with "
        "the gap (prompt overfitting, PromptRL); null skips it.",
    )
    paraphrase_num_prompts: int = _f(
        0, "Paraphrases per evaluation (evenly spaced through the file); 0: all of them.", valid=">= 0"
    )
    gold: list[RewardSpec] = _f(
        [],
        "The gold panel: rewards each evaluation also scores and the run does not optimise (entries as "
        "in `rewards`; weights unused), logged as eval/gold/<label>/mean and /se; the guard watches them "
        "(docs/TRAINING.md, 'Guarding against reward hacking').",
    )
    monitors: bool = _f(
        True,
        "Artefact and diversity monitors that need no reward model (grid energy, over-exposure, "
        "saturation, colour drift from the first evaluation, spread across prompts; video: flicker): "
        "eval/monitor/...",
    )


@dataclass
class GuardConfig:
    gold_drop_se: float | None = _f(
        None,
        "Alarm when a gold reward has fallen from its best evaluation by more than this many standard "
        "errors while the trained reward has risen since that evaluation; null: no such rule.",
        valid="> 0",
    )
    limits: dict = _f(
        {},
        "Alarm when a monitor has moved past a bound since the first evaluation: {name: bound}, e.g. "
        "{grid_energy: 0.05, colour_drift: 0.3}; a negative bound alarms on a fall (exposure: -0.1).",
    )
    keep_best: str | None = _f(
        None,
        "Keep the checkpoint of the evaluation with the best value of this logged key (e.g. "
        "eval/gold/hpsv21/mean) among those without an alarm, in <run>/checkpoints/best; null: the first "
        "gold reward's mean, if there is a gold panel.",
    )
    stop: bool = _f(False, "Stop the run at the first alarm (after saving its checkpoint).")


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
    every: int = _f(
        0, "Checkpoint every N iterations (and at the end); 0 saves only at the end.", valid=">= 0"
    )
    keep: int = _f(3, "Keep the newest N checkpoints; 0 keeps all.", valid=">= 0")
