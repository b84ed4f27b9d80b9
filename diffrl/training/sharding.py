"""Whole tensors in, sharded tensors out: what checkpoints and exports need under FSDP.

Under FSDP2 every parameter is a DTensor holding this process's shard. Checkpoints and
the diffusers LoRA export store whole tensors, so that a checkpoint does not depend on
the number of processes that wrote it and a LoRA file loads into any pipeline. Gathering
is a collective: every process must call :func:`whole` for the same tensors in the same
order (accelerate calls a registered object's ``state_dict`` on every process, and
``save_checkpoint`` gathers before the main process writes). Without FSDP both helpers
are plain copies.
"""

from __future__ import annotations

import torch


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor cannot shard: nothing is ever a DTensor
        return None
    return DTensor


def is_sharded(t: torch.Tensor) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(t, kind)


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``t`` (all-gathered from every process if ``t`` is a
    shard), detached."""
    t = t.detach()
    return t.full_tensor() if is_sharded(t) else t


def like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``target``: sharded with its mesh and placements when
    ``target`` is a shard (collective), else moved to its device and dtype."""
    full = full.to(device=target.device, dtype=target.dtype)
    if not is_sharded(target):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, target.device_mesh, target.placements)


def fsdp_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules FSDP wraps one by one: those whose class the model names in
    ``_no_split_modules`` (a diffusers model's transformer blocks), as accelerate's
    transformer-based wrap policy picks them."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in module.modules() if m is not module and type(m).__name__ in names]


def shard_frozen_copy(module: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """Shard a frozen module (full fine-tuning's reference copy) the way the policy is
    sharded: each transformer block, then the root. Its forwards then gather one block at
    a time instead of every process holding the whole copy."""
    from torch.distributed.fsdp import fully_shard

    for unit in fsdp_units(module):
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def reshard(module: torch.nn.Module) -> None:
    """Free every gathered FSDP unit of ``module`` so its parameters are the shards again.

    FSDP2 keeps the root unit gathered after a forward that no backward follows (rollouts,
    evaluation, the old policy's forward): its parameters are then plain tensors, not the
    shards the optimizer, the EMA and the checkpoints hold, and weights written into the
    shards (an EMA swap, an old-policy swap) would not reach the next forward. Called
    before parameters are read or swapped and after every forward without backward.
    A no-op without FSDP, and for units already sharded."""
    for unit in module.modules():
        if hasattr(unit, "reshard") and type(unit).__name__.startswith("FSDP"):
            unit.reshard()


def refuse_unsharded_stages(cfg, fsdp: bool) -> None:
    """Sol-RL regenerates sub-trees whose shapes differ between processes, so under FSDP
    its processes would run different numbers of sharded forwards (each a collective) and
    hang: refused, before any model is built, until those forwards are padded."""
    if fsdp and cfg.solrl.enabled:
        from diffrl.config import ConfigError

        raise ConfigError(
            "solrl.enabled does not run under FSDP yet (its regenerations run different "
            "numbers of sharded forwards on different processes); launch it with DDP "
            "(accelerate launch without --use_fsdp)"
        )
