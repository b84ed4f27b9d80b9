"""Cross-field configuration checks (split from :mod:`diffrl.config`, which holds the
typed sections and their loading): group sizes, SDE windows, tree shapes, Sol-RL
subsets and objective parameters. Each failure is one :class:`ConfigError` naming the
key and the fix."""

from __future__ import annotations

import math

from diffrl.config import ConfigError


def check(cfg) -> None:
    """Cross-field checks that types alone cannot express."""
    _check_ranges(cfg)
    _check_sampling(cfg)
    if cfg.solrl.enabled:
        _check_solrl(cfg)
    _check_precision(cfg)
    obj = cfg.objective
    if (
        obj.nft_beta <= 0
        or obj.nft_old_decay_flat < 0
        or obj.nft_old_decay_rate < 0
        or not 0 <= obj.nft_old_decay_max < 1
    ):
        raise ConfigError(
            "objective.nft_beta must be > 0, nft_old_decay_flat and nft_old_decay_rate >= 0, "
            "nft_old_decay_max in [0, 1)"
        )
    if obj.nft_sample_with == "old" and (obj.name != "nft" or cfg.solrl.enabled):
        raise ConfigError(
            "objective.nft_sample_with old needs objective.name nft and no solrl (Sol-RL explores "
            "with its own copy of the trained weights)"
        )
    _check_objective(cfg)
    _check_model(cfg)
    _check_toy_prompts(cfg)
    if obj.anchor_coef < 0 or not 0 < obj.anchor_fraction <= 1:
        raise ConfigError("objective.anchor_coef must be >= 0 and objective.anchor_fraction in (0, 1]")
    _check_tree_anchor(cfg)


def _check_ranges(cfg) -> None:
    """Single values out of their range."""
    checks = [
        (cfg.rollout.group_size >= 2, "rollout.group_size must be >= 2 for group-relative advantages"),
        (cfg.rollout.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1"),
        (cfg.rollout.batch_size >= 1, "rollout.batch_size must be >= 1"),
        (cfg.sampling.num_steps >= 1, "sampling.num_steps must be >= 1"),
        (0 < cfg.objective.timestep_fraction <= 1, "objective.timestep_fraction must be in (0, 1]"),
        (cfg.train.micro_batch_size >= 1, "train.micro_batch_size must be >= 1"),
        (cfg.train.gradient_accumulation >= 1, "train.gradient_accumulation must be >= 1"),
        (cfg.train.max_steps >= 0, "train.max_steps must be >= 0"),
        (0 <= cfg.train.ema_decay < 1, "train.ema_decay must be in [0, 1)"),
        (
            cfg.train.ema_update_every >= 1 and cfg.train.ema_repeats >= 1,
            "train.ema_update_every and train.ema_repeats must be >= 1",
        ),
        (cfg.train.collective_timeout_minutes > 0, "train.collective_timeout_minutes must be > 0"),
        (len(cfg.rewards) >= 1, "rewards: at least one reward is required"),
        (
            cfg.model.height % 16 == 0 and cfg.model.width % 16 == 0,
            "model.height and model.width must be multiples of 16",
        ),
        (len(cfg.optim.betas) == 2, "optim.betas must have two values"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _check_sampling(cfg) -> None:
    """The SDE window, the solver and the strategy's own settings."""
    _check_sde_window(cfg.sampling)
    if cfg.sampling.ode_solver == "dpm2" and (
        cfg.sampling.sde_type != "ode" or cfg.rollout.strategy != "independent"
    ):
        raise ConfigError(
            "sampling.ode_solver: dpm2 is a multistep solver for deterministic rollouts: it needs "
            "sampling.sde_type: ode and rollout.strategy: independent"
        )
    if cfg.rollout.strategy == "tree":
        _check_tree(cfg)
        if cfg.objective.timestep_selection == "first":
            raise ConfigError(
                "objective.timestep_selection: first is for independent rollouts; a tree keeps the "
                "timestep_fraction share of each step's edges (set it to random)"
            )


def _check_tree_anchor(cfg) -> None:
    """Trees anchor their ODE steps through the edge plan, which only the transition
    objectives use: a clean-sample objective trains a tree's leaves as independent samples."""
    from diffrl.algorithms import get_objective

    name = cfg.objective.name
    if (
        cfg.objective.anchor_coef > 0
        and cfg.rollout.strategy == "tree"
        and get_objective(name).forward_process
    ):
        raise ConfigError(
            f"objective.anchor_coef on trees needs a transition objective (flow_grpo family); {name} "
            "trains the leaves as independent samples: set objective.anchor_coef to 0"
        )


def _check_sde_window(sampling) -> None:
    window = sampling.sde_window
    if window is not None and not (len(window) == 2 and 0 <= window[0] < window[1] <= sampling.num_steps):
        raise ConfigError(
            f"sampling.sde_window must be [start, end) within [0, {sampling.num_steps}], got {window}"
        )
    if sampling.sde_window_slide_every < 0 or sampling.sde_window_slide_stride < 1:
        raise ConfigError(
            "sampling.sde_window_slide_every must be >= 0 and sampling.sde_window_slide_stride >= 1"
        )
    placement = sampling.sde_window_range
    if placement is None:
        return
    if window is None or sampling.sde_window_slide_every > 0:
        raise ConfigError(
            "sampling.sde_window_range places a window at random: it needs sampling.sde_window (whose size "
            "it keeps) and no sliding (sampling.sde_window_slide_every: 0)"
        )
    size = window[1] - window[0]
    if not (
        len(placement) == 2
        and 0 <= placement[0]
        and placement[0] + size <= min(placement[1], sampling.num_steps)
    ):
        raise ConfigError(
            f"sampling.sde_window_range must be [lo, hi] with room for the window of {size} step(s) within "
            f"[0, {sampling.num_steps}], got {placement}"
        )


def _check_model(cfg) -> None:
    """Family-specific model keys: Wan2.2's low-noise CFG scale and its LoRA-only training,
    and the attention backends a family that masks text tokens can use."""
    _check_attention_mask_support(cfg)
    model = cfg.model
    if model.guidance_scale_2 is not None and model.family != "wan22":
        raise ConfigError(
            f"model.guidance_scale_2 is the CFG scale of Wan2.2's low-noise expert; family "
            f"'{model.family}' has one transformer: remove it (or use model.family: wan22)"
        )
    if model.guidance_scale_2 is not None and model.guidance_scale <= 1 < model.guidance_scale_2:
        raise ConfigError(
            "model.guidance_scale_2 only applies when model.guidance_scale > 1: WanPipeline runs CFG "
            "on both experts or on neither; raise model.guidance_scale or drop guidance_scale_2"
        )
    if model.full_finetune and model.dtype != "float32" and cfg.train.mixed_precision == "no":
        raise ConfigError(
            f"model.full_finetune with model.dtype {model.dtype} needs train.mixed_precision: "
            f"{'bf16' if model.dtype == 'bfloat16' else 'fp16'}: the trained weights are kept in "
            "fp32 (an update of lr 1e-5 is below bf16's resolution) and forwards run under autocast"
        )
    if model.family == "wan22" and model.full_finetune:
        raise ConfigError(
            "model.full_finetune is not supported for wan22: two 14B experts plus their frozen "
            "reference do not fit the GPUs it would run on; train LoRA (model.full_finetune: false)"
        )


# models that are not real: the tiny twins, the ShapeWorld toys, random weights at a
# published architecture (a measurement); their runs may use the shipped toy prompts
TOY_MODELS = ("tiny", "shapeworld", "shapeworld_late", "shapeworld_video")


def is_real_model(pretrained: str) -> bool:
    from pathlib import Path

    from diffrl.data.prompts import PROJECT_ROOT

    if pretrained in TOY_MODELS or pretrained.startswith("random:"):
        return False
    path = Path(pretrained).expanduser()
    shipped = path if path.is_absolute() else PROJECT_ROOT / path
    return not (shipped.is_dir() and (PROJECT_ROOT / "assets") in shipped.resolve().parents)


def _check_toy_prompts(cfg) -> None:
    """A real model on the shipped toy prompts is no experiment: refused, unless the
    config says so (``data.allow_toy_prompts``)."""
    from diffrl.data import is_set_name
    from diffrl.data.prompts import PROJECT_ROOT, resolve_prompt_path

    if cfg.data.allow_toy_prompts or not is_real_model(cfg.model.pretrained):
        return
    for key in ("train_prompts", "eval_prompts"):
        value = getattr(cfg.data, key)
        if is_set_name(value):
            continue
        path = resolve_prompt_path(value).resolve()
        if (PROJECT_ROOT / "assets") in path.parents:
            raise ConfigError(
                f"data.{key} '{value}' is a shipped toy prompt file, and model.pretrained "
                f"'{cfg.model.pretrained}' is a real model: name a prompt set (diffrl-data list; e.g. "
                "pickscore/train, geneval/train, hpdv2/train) or your own file, or set "
                "data.allow_toy_prompts: true to run on the toy prompts anyway"
            )


def _masked_attention_unsupported(backend: str) -> bool:
    """diffusers backends that raise on an attention mask (flash-attn 2/3/4 and native flash,
    Sage, AITER, XLA; the varlen flash kernels take masks as sequence lengths)."""
    return ("flash" in backend and "varlen" not in backend) or any(
        k in backend for k in ("sage", "aiter", "xla")
    )


def _check_attention_mask_support(cfg) -> None:
    """A family whose text tokens are padded and masked (Qwen-Image) cannot run on a
    mask-less attention backend: diffusers would raise inside the first rollout."""
    backend = cfg.perf.attention_backend
    if not backend or not _masked_attention_unsupported(backend):
        return
    from diffrl.models import adapter_class

    if adapter_class(cfg.model.family).masks_text_tokens:
        raise ConfigError(
            f"perf.attention_backend '{backend}' takes no attention mask, and model family "
            f"'{cfg.model.family}' masks its padded text tokens; use _native_cudnn, flash_varlen or null"
        )


def _check_tree(cfg) -> None:
    """The tree must fit the schedule and have exactly ``group_size`` leaves per prompt."""
    tree, steps = cfg.tree, cfg.sampling.num_steps
    splits = tree.split_steps
    if not splits or sorted(set(splits)) != list(splits) or not all(0 <= s < steps for s in splits):
        raise ConfigError(f"tree.split_steps must be increasing step indices in [0, {steps}), got {splits}")
    factors = tree.branch_factors
    if len(factors) not in (1, len(splits)) or any(f < 1 for f in factors):
        raise ConfigError(
            f"tree.branch_factors needs one value >= 1 or one per split step ({len(splits)}), got {factors}"
        )
    leaves = math.prod(factors * len(splits) if len(factors) == 1 else factors)
    want, key = (
        (cfg.solrl.pool_size, "solrl.pool_size")
        if cfg.solrl.enabled
        else (cfg.rollout.group_size, "rollout.group_size")
    )
    if leaves != want:
        raise ConfigError(
            f"the tree has {leaves} leaves per prompt but {key} is {want}; "
            f"set {key} to the product of tree.branch_factors"
        )
    if cfg.sampling.sde_type == "ode":
        raise ConfigError("tree splits need a stochastic step: set sampling.sde_type to sde, cps or dance")
    if tree.edges_per_step < 0:
        raise ConfigError("tree.edges_per_step must be >= 0 (0: the leaves decide the optimizer steps)")
    if tree.split_noise_scale <= 0 or tree.fusion_temperature <= 0 or not 0 < tree.width_keep_fraction <= 1:
        raise ConfigError(
            "tree.split_noise_scale and tree.fusion_temperature must be > 0, "
            "tree.width_keep_fraction in (0, 1]"
        )
    if not all(0 <= d < steps for d in tree.depth_pruning):
        raise ConfigError(
            f"tree.depth_pruning must list step indices in [0, {steps}), got {tree.depth_pruning}"
        )
    if tree.depth_pruning_slide_every < 0 or not 0 <= tree.depth_pruning_stop < steps:
        raise ConfigError(
            f"tree.depth_pruning_slide_every must be >= 0 and tree.depth_pruning_stop in [0, {steps})"
        )
    level_scale = tree.split_noise_scale if tree.split_noise == "level" else 1.0
    if cfg.sampling.sde_type == "cps" and (cfg.sampling.noise_level * level_scale > 1 or steps - 1 in splits):
        # cps: std = sigma_next sin(a pi / 2) grows with a only up to a = 1, and is 0 at the last step
        raise ConfigError(
            "with sampling.sde_type cps and tree.split_noise level, sampling.noise_level * "
            "tree.split_noise_scale must be <= 1 "
            f"and no split may be at the last step ({steps - 1})"
        )
    if tree.reward_fusion == "prob_weighted" and cfg.objective.logprob_reduction == "sum":
        raise ConfigError(
            "tree.reward_fusion prob_weighted needs objective.logprob_reduction mean: with sum, the "
            "softmax over sibling log-probs puts all weight on the child with the smallest noise draw"
        )


def _check_solrl(cfg) -> None:
    sol = cfg.solrl
    if not 2 <= cfg.rollout.group_size <= sol.pool_size:
        raise ConfigError(
            f"solrl: rollout.group_size ({cfg.rollout.group_size}) samples per prompt are selected from "
            f"solrl.pool_size ({sol.pool_size}) candidates; need 2 <= group_size <= pool_size"
        )
    if sol.explore == "ode" and cfg.rollout.strategy != "independent":
        raise ConfigError(
            "solrl.explore ode replays only the initial noise, which a tree pool does not fix; use "
            "rollout.strategy independent, or solrl.explore replay"
        )
    if sol.explore_num_steps is not None and (sol.explore != "ode" or sol.explore_num_steps < 1):
        raise ConfigError(
            "solrl.explore_num_steps needs solrl.explore ode and a value >= 1 (replay pools use the "
            "training schedule so that their noise can be replayed)"
        )
    if cfg.rollout.strategy == "tree" and cfg.tree.width_pruning != "none":
        raise ConfigError(
            "solrl with a tree pool: the selection already keeps best and worst leaves; set "
            "tree.width_pruning none"
        )


def _check_precision(cfg) -> None:
    """The FP8 precision flow: FP8 training needs FP8 rollouts (the unified flow), and it
    is Sol-RL's alternative, not an addition to it."""
    p = cfg.precision
    if p.train == "fp8" and p.rollout != "fp8":
        raise ConfigError(
            "precision.train fp8 needs precision.rollout fp8: the unified flow samples and trains "
            "through one quantizer (BF16 rollouts scored by an FP8 update would be off-policy again)"
        )
    quantized = "fp8" in (p.rollout, p.train)
    if quantized and cfg.solrl.enabled:
        raise ConfigError(
            "precision.rollout/train fp8 and solrl are the two answers to low-precision RL: Sol-RL explores "
            "with a quantized copy and trains on BF16 regenerations, the precision flow samples and trains "
            "the policy itself in FP8. Set solrl.enabled false, or precision.rollout and train bf16"
        )
    if quantized and cfg.model.lora.dropout > 0 and not cfg.model.full_finetune:
        raise ConfigError("precision fp8 merges LoRA into each weight: set model.lora.dropout 0")


def _check_objective(cfg) -> None:
    """What the chosen objective supports (its ``strategies``) and needs, and the ranges
    of its parameters."""
    from diffrl.algorithms import get_objective

    obj = cfg.objective
    try:
        objective = get_objective(obj.name)
    except ValueError as err:  # the registry's message names the valid ones and the nearest
        raise ConfigError(f"objective.name: {err}") from None
    used = [cfg.rollout.strategy] + (["solrl"] if cfg.solrl.enabled else [])
    for strategy in used:
        if strategy not in objective.strategies:
            raise ConfigError(
                f"objective {obj.name} does not support {strategy} rollouts; it supports "
                f"{', '.join(objective.strategies)}"
            )
    positive = {
        "awm_huber_power": obj.awm_huber_power,
        "awm_advantage_max": obj.awm_advantage_max,
        "dgpo_beta": obj.dgpo_beta,
        "dppo_kl_threshold": obj.dppo_kl_threshold,
    }
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"objective.{key} must be > 0, got {value}")
    if obj.awm_ema_beta < 0:
        raise ConfigError(f"objective.awm_ema_beta must be >= 0, got {obj.awm_ema_beta}")
    if obj.name == "grpo_guard" and obj.logprob_reduction != "mean":
        raise ConfigError(
            "objective grpo_guard normalises the mean-reduced log-ratio: set objective.logprob_reduction mean"
        )
    if objective.whole_groups and cfg.train.micro_batch_size % cfg.rollout.group_size:
        raise ConfigError(
            f"objective {obj.name} trains whole prompt groups in one forward: make "
            f"train.micro_batch_size ({cfg.train.micro_batch_size}) a multiple of rollout.group_size "
            f"({cfg.rollout.group_size})"
        )
    _check_forward_window(cfg, objective)


def _check_forward_window(cfg, objective) -> None:
    window, steps = cfg.objective.forward_window, cfg.sampling.num_steps
    if window is None:
        return
    if not objective.forward_process:
        raise ConfigError(
            f"objective.forward_window applies to clean-sample objectives (nft, awm, dgpo), not "
            f"{cfg.objective.name}: its trained steps are the SDE window (sampling.sde_window)"
        )
    if not (len(window) == 2 and 0 <= window[0] < window[1] <= steps):
        raise ConfigError(f"objective.forward_window must be [start, end) within [0, {steps}], got {window}")
