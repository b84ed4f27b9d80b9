"""The sampling settings' own checks (the ``sampling``, ``rollout`` and ``tree`` sections),
called when a config loads (:func:`diffrl.config.validate`): the SDE window, the solver,
and a tree that fits the schedule and the group."""

from __future__ import annotations

import math

from diffrl.schema import ConfigError


def check_sampling(cfg) -> None:
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
        raise ConfigError(
            "tree splits need a stochastic step: set sampling.sde_type to sde, cps, dance or consistency"
        )
    if tree.shared_root_noise < 1:
        raise ConfigError(
            f"tree.shared_root_noise must be >= 1 (1: every tree its own), got {tree.shared_root_noise}"
        )
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
