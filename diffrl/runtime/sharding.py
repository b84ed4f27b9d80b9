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

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator

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


def is_main_process() -> bool:
    """Rank 0 of the default process group, or the only process."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def gathered_to_cpu(tensors: Iterable[tuple[str, torch.Tensor]], keep: bool | None = None) -> dict:
    """Whole copies of ``tensors`` on the CPU, gathered **one at a time**: each shard is
    all-gathered, copied to the host and released before the next, so a process holds at
    most one whole tensor on the device (gathering all at once held a whole fp32 model on
    every GPU: 44 GiB for FLUX). Collective under FSDP: every process calls it with the same
    tensors in the same order. Only ``keep`` processes (default: the main one, which writes)
    keep the copies; the others return an empty dict after taking part in the gathers."""
    keep = is_main_process() if keep is None else keep
    out = {}
    for name, t in tensors:
        full = whole(t)
        if keep:
            out[name] = full.to("cpu", copy=True)
        del full  # the gathered buffer goes before the next gather
    return out


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
    kind = _fsdp_module_type()
    for unit in module.modules():
        if kind is not None and isinstance(unit, kind):
            unit.reshard()


def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing is ever sharded by it
        return None
    return FSDPModule


def _owner(name: str, units: list[str]) -> str:
    """The innermost unit prefix holding module ``name`` ("" is the root)."""
    best = ""
    for prefix in units:
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return best


@contextlib.contextmanager
def _gathered(unit: torch.nn.Module | None):
    if unit is None:
        yield
        return
    unit.unshard()  # collective: every process gathers the same unit
    try:
        yield
    finally:
        unit.reshard()


def units_gathered(module: torch.nn.Module) -> Iterator[Callable[[str], bool]]:
    """Visit ``module``'s FSDP units one at a time, each gathered while it is visited.

    Yields, per unit, ``owns(name)``: whether the parameters held directly by the
    submodule named ``name`` are the gathered (plain, whole) ones now. Reading a
    sharded model unit by unit keeps the extra memory to one transformer block, not the
    whole model. Every process must visit the units together (each gather is a
    collective); the order is ``named_modules`` order, the same everywhere. Without FSDP
    it yields once, owning everything."""
    kind = _fsdp_module_type()
    units = {n: m for n, m in module.named_modules() if kind is not None and isinstance(m, kind)}
    if not units:
        with _gathered(None):
            yield lambda _name: True
        return
    prefixes = list(units)
    # each name's owner, found once: the sync asks about every name once per unit
    owner = functools.lru_cache(maxsize=None)(lambda name: _owner(name, prefixes))
    for prefix, unit in units.items():
        with _gathered(unit):
            yield lambda name, prefix=prefix: owner(name) == prefix


def max_over_processes(accelerator, counts: list[int]) -> list[int]:
    """Elementwise maximum of ``counts`` over every process (a collective)."""
    if accelerator.num_processes == 1:
        return list(counts)
    local = torch.tensor([list(counts)], dtype=torch.long, device=accelerator.device)
    return [int(n) for n in accelerator.gather(local).cpu().amax(0).tolist()]


def mean_over_processes(accelerator, counts: list[int]) -> list[float]:
    """Elementwise mean of ``counts`` over every process (a collective)."""
    local = torch.tensor([list(counts)], dtype=torch.float64, device=accelerator.device)
    return accelerator.gather(local).cpu().mean(0).tolist()
