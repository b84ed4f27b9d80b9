"""The precision and solrl sections' own checks, called when a config loads
(:func:`diffrl.config.validate`): Sol-RL's pool and selection, and the FP8 flow's phases."""

from __future__ import annotations

from diffrl.schema import ConfigError


def check_precision(cfg) -> None:
    if cfg.solrl.enabled:
        _check_solrl(cfg)
    _check_flow(cfg)


def _check_solrl(cfg) -> None:
    sol = cfg.solrl
    if sol.min_quantized_dim < 0:
        raise ConfigError(f"solrl.min_quantized_dim must be >= 0 (0: none), got {sol.min_quantized_dim}")
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


def _check_flow(cfg) -> None:
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
