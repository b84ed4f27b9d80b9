"""What a run really holds, measured, to check :func:`diffrl.perf.estimate.estimate_built`.

On a GPU the caching allocator's peak (``torch.cuda.max_memory_allocated``) is the
measure. A CPU has no allocator statistics, so there the measure is an inventory: every
tensor the Python garbage collector can reach (parameters, gradients, optimizer state,
EMA shadows, exploration copies, rollout buffers), each storage counted once. Tensors
only autograd's C++ graph holds (saved activations) are invisible to it, which is why
:class:`PeakBeforeOptimizerStep` takes the inventory right before an optimizer step: the
passes are over, the gradients and AdamW's moments are alive, the activations are gone.
"""

from __future__ import annotations

import gc

import torch


def live_tensor_bytes(device: str | torch.device = "cpu") -> int:
    """Bytes of every distinct tensor storage on ``device`` reachable from Python."""
    device = torch.device(device)
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some deprecated
        # module-level objects (torch.distributed.reduce_op) answer with a warning
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != device.type or obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a wrapper (FSDP's DTensor): its local shard is counted
            continue
        storages[pointer] = max(storages.get(pointer, 0), storage.nbytes())
    storages.pop(0, None)  # empty tensors share the null pointer
    return sum(storages.values())


class PeakBeforeOptimizerStep:
    """The largest :func:`live_tensor_bytes` seen right before any step of ``optimizer``
    (a ``torch.optim`` optimizer, or accelerate's wrapper around one)."""

    def __init__(self, optimizer, device: str | torch.device = "cpu"):
        inner = getattr(optimizer, "optimizer", optimizer)
        self.samples: list[int] = []
        self._handle = inner.register_step_pre_hook(lambda *_: self.samples.append(live_tensor_bytes(device)))

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)

    def remove(self) -> None:
        self._handle.remove()
