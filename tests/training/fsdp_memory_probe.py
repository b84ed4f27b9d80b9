"""Run under ``torchrun --nproc_per_node 2`` with FSDP (tests/training/test_fsdp_memory.py):
a full fine-tune of a mid-size toy model (about 9 M parameters, 36 MB per fp32 copy),
measuring what each process holds. Writes one JSON line per process to ``argv[1]``.

What it records:
* ``moved_whole``: the devices the adapter was moved to whole (before ``prepare`` that put
  the whole model on every GPU before sharding; under FSDP it must never happen);
* ``gradient_sync_turned_off``: how often FSDP2's gradient sync was switched off (accelerate's
  ``no_sync``), which keeps whole gradients on every process between passes;
* local bytes of the trainable weights and of the frozen reference after start-up;
* with ``rss`` as a third argument, the growth of the resident set (peak minus start,
  from /proc) during a second training iteration, once the optimizer state exists, and
  over its forward and backward passes alone (up to the first optimizer step):
  gradients, gathered blocks and activations, which must not include whole gradients.
  Run it with MALLOC_MMAP_THRESHOLD_ set low, so freed tensors leave the resident set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# build_tiny asks for 2 layers of 2 heads; this widens the toy to about 9 M parameters
MID_SIZE = {"layers": 4, "heads": 8, "head_dim": 32}


def _mid_size_toy() -> None:
    import diffrl.models.toy as toy

    small = toy.build_components
    toy.build_components = lambda **kw: small(**{**kw, **MID_SIZE})


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _local_bytes(module: torch.nn.Module) -> int:
    total = 0
    for p in module.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def _spies() -> tuple[list, list]:
    """Record every whole-adapter move to a device, and every time FSDP2's gradient sync
    is switched off (accelerate's no_sync: whole gradients then accumulate everywhere)."""
    from torch.distributed.fsdp import FSDPModule

    from diffrl.models.base import FlowAdapter

    moved, unsynced = [], []
    original_to, original_sync = FlowAdapter.to, FSDPModule.set_requires_gradient_sync

    def spy_to(self, device):
        moved.append(str(device))
        return original_to(self, device)

    def spy_sync(self, requires, *args, **kwargs):
        if not requires:
            unsynced.append(type(self).__name__)
        return original_sync(self, requires, *args, **kwargs)

    FlowAdapter.to, FSDPModule.set_requires_gradient_sync = spy_to, spy_sync
    return moved, unsynced


def main(out: str, run_dir: str, measure_rss: bool = False) -> None:
    _mid_size_toy()
    from diffrl.config import load_config
    from diffrl.training.trainer import Trainer

    moved, unsynced = _spies()
    sets = [
        f"output_dir={run_dir}",
        "model.full_finetune=true",
        "objective.kl_coef=0.01",
        "train.max_steps=2",
        "train.micro_batch_size=2",  # several passes per optimizer step: gradients accumulate
        "eval.every=0",
        "eval.at_start=false",
        "checkpoint.every=0",
        "logging.progress_bar=false",
    ]
    trainer = Trainer(load_config("tiny_toy_flowgrpo", sets))
    # fp32 master weights: 4 bytes for every element of the whole (unsharded) parameters
    whole = sum(4 * p.numel() for p in trainer.policy.trainable_parameters())
    trainer.train_step(0)  # creates the optimizer state; the spies watch its passes
    rss = _rss_of_a_second_step(trainer) if measure_rss else {}
    reference = trainer.policy.frozen_reference
    row = {
        "rank": trainer.acc.process_index,
        "processes": trainer.acc.num_processes,
        "fsdp": trainer.acc.distributed_type.value,
        "moved_whole": moved,
        "whole_trainable_bytes": whole,
        "local_trainable_bytes": _local_bytes(trainer.adapter.transformer),
        "local_reference_bytes": _local_bytes(reference),
        "whole_reference_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
        "gradient_sync_turned_off": len(unsynced),
        **rss,
    }
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def _rss_of_a_second_step(trainer) -> dict:
    before_step = []  # the peak over the forward and backward passes, before AdamW's own temporaries
    optimizer_step = trainer.optimizer.step

    def step(*args, **kwargs):
        before_step.append(_rss_kib("VmHWM"))
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = step
    start = _rss_kib("VmRSS")
    peak_known = _reset_peak()
    trainer.train_step(1)
    growth = (_rss_kib("VmHWM") - start) * 1024
    passes_growth = (before_step[0] - start) * 1024
    return {
        "step_rss_growth_bytes": growth if peak_known else None,
        "passes_rss_growth_bytes": passes_growth if peak_known else None,
    }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], measure_rss="rss" in sys.argv[3:])
