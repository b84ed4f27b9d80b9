"""Memory estimates for a config at full size, computed on the meta device.

``saved_activation_bytes`` counts the tensors autograd keeps for the backward pass of a
training forward (the dominant, batch-proportional part of training memory), through
``torch.autograd.graph.saved_tensors_hooks``; parameters are excluded and views of one
tensor are counted once. The rest of a step's footprint is arithmetic on parameter
counts (:mod:`diffrl.perf.estimate`). These are estimates: allocator fragmentation and the
largest transient buffers are not modelled, which is why ``docs/BENCHMARKS.md`` keeps
them apart from measured peaks.
"""

from __future__ import annotations

import torch

GIB = 2**30


def saved_activation_bytes(fn) -> int:
    """Bytes of non-parameter tensors saved for backward while ``fn()`` runs its forward."""
    kept: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor):
        base = t if t._base is None else t._base
        if not isinstance(base, torch.nn.Parameter):
            kept[id(base)] = base  # holding it keeps ids unique for the whole forward
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(t.untyped_storage().nbytes() for t in kept.values())


def param_bytes(module: torch.nn.Module, trainable: bool | None = None) -> int:
    return sum(
        p.numel() * p.element_size()
        for p in module.parameters()
        if trainable is None or p.requires_grad == trainable
    )


def buffer_bytes(module: torch.nn.Module) -> int:
    """Buffer bytes of ``module``: never trained, never sharded by FSDP2 (``fully_shard``
    shards parameters only), and not small everywhere: SD3's position table is a
    (1, 384^2, 1536) fp32 buffer, 0.84 GiB at SD3.5 size (seen on an H100)."""
    return sum(b.numel() * b.element_size() for b in module.buffers())


def module_bytes(module) -> int:
    """Parameter and buffer bytes of ``module`` (0 for a weight-free reward)."""
    if not isinstance(module, torch.nn.Module):
        return 0
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
