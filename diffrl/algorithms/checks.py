"""The objective section's own checks, called when a config loads
(:func:`diffrl.config.validate`): what the chosen objective supports and needs, the
ranges of its parameters (each objective's ``args`` checks its own), the velocity
anchor, and the forward window of the clean-sample objectives."""

from __future__ import annotations

from diffrl.algorithms.objective import get_objective
from diffrl.schema import ConfigError


def check_objective(cfg) -> None:
    obj = cfg.objective
    objective = get_objective(obj.name)  # a known name: the loader read its args already
    _check_supported(cfg, objective)
    obj.args.check()
    if obj.anchor_coef < 0 or not 0 < obj.anchor_fraction <= 1:
        raise ConfigError("objective.anchor_coef must be >= 0 and objective.anchor_fraction in (0, 1]")
    _check_tree_anchor(cfg, objective)
    _check_forward_window(cfg, objective)
    _check_drop_zero(cfg, objective)
    _check_prompt_history(cfg)
    _check_consistency(cfg)


def _check_prompt_history(cfg) -> None:
    """DDPO's per-prompt statistics key each sample by its prompt: independent rollouts, the
    whole iteration's samples (not a tree's nodes, not Sol-RL's regenerated subset)."""
    if cfg.advantage.estimator != "prompt_history":
        return
    if cfg.rollout.strategy != "independent" or cfg.solrl.enabled:
        raise ConfigError(
            "advantage.estimator prompt_history normalises every sample of an iteration by its prompt's "
            "history: it needs rollout.strategy independent and solrl.enabled false"
        )


def _check_consistency(cfg) -> None:
    """RLCM is defined on consistency sampling's MDP, where its log-probs are exact."""
    if cfg.objective.name == "rlcm" and cfg.sampling.sde_type != "consistency":
        raise ConfigError(
            "objective rlcm trains on multistep consistency sampling: set sampling.sde_type consistency "
            "(or choose objective flow_grpo for the SDE samplers)"
        )
    if cfg.objective.name == "rlcm" and cfg.objective.kl_coef > 0:
        raise ConfigError("objective rlcm has no KL term (RLCM trains without one): set objective.kl_coef 0")
    last = cfg.sampling.num_steps - 1
    if (
        cfg.sampling.sde_type == "consistency"
        and cfg.rollout.strategy == "tree"
        and last in cfg.tree.split_steps
    ):
        raise ConfigError(
            f"with sampling.sde_type consistency the last step ({last}) returns the predicted clean "
            "sample without noise: no tree split may be there"
        )
    if cfg.sampling.sde_type == "consistency" and cfg.sampling.num_steps < 2:
        raise ConfigError(
            "sampling.sde_type consistency with one step has no stochastic transition to train: set "
            "sampling.num_steps to 2 or more"
        )


def _check_drop_zero(cfg, objective) -> None:
    """advantage.drop_zero re-lays the kept samples out over the micro-batches: samples,
    not a tree's edges, and not whole prompt groups."""
    if not cfg.advantage.drop_zero:
        return
    if cfg.rollout.strategy == "tree" and not objective.forward_process:
        raise ConfigError(
            "advantage.drop_zero lays out independent samples; a tree trains edges (tree.width_pruning "
            "and depth_pruning choose them): set advantage.drop_zero false"
        )
    if objective.whole_groups:
        raise ConfigError(
            f"advantage.drop_zero would split the whole prompt groups objective {cfg.objective.name} "
            "trains on: set advantage.drop_zero false"
        )


def _check_tree_anchor(cfg, objective) -> None:
    """Trees anchor their ODE steps through the edge plan, which only the transition
    objectives use: a clean-sample objective trains a tree's leaves as independent samples."""
    name = cfg.objective.name
    if cfg.objective.anchor_coef > 0 and cfg.rollout.strategy == "tree" and objective.forward_process:
        raise ConfigError(
            f"objective.anchor_coef on trees needs a transition objective (flow_grpo family); {name} "
            "trains the leaves as independent samples: set objective.anchor_coef to 0"
        )


def _check_supported(cfg, objective) -> None:
    """What the chosen objective supports (its ``strategies``) and needs."""
    obj = cfg.objective
    used = [cfg.rollout.strategy] + (["solrl"] if cfg.solrl.enabled else [])
    for strategy in used:
        if strategy not in objective.strategies:
            raise ConfigError(
                f"objective {obj.name} does not support {strategy} rollouts; it supports "
                f"{', '.join(objective.strategies)}"
            )
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
