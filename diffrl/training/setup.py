"""What a run starts with besides the model: the accelerator (with the trackers that are
actually installed) and the learning-rate schedule."""

from __future__ import annotations

import datetime
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, ProjectConfiguration

from diffrl.config import Config


def make_accelerator(cfg: Config) -> Accelerator:
    project = ProjectConfiguration(project_dir=str(cfg.run_dir), logging_dir=str(cfg.run_dir / "logs"))
    from diffrl.training.tracking import check_trackers

    trackers = check_trackers(cfg.logging.trackers) or None
    # the process group's timeout: every collective waits this long for the slowest process
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=cfg.train.collective_timeout_minutes))
    acc = Accelerator(
        mixed_precision=cfg.train.mixed_precision,
        log_with=trackers,
        project_config=project,
        kwargs_handlers=[timeout],
    )
    if fsdp_requested() and acc.distributed_type == DistributedType.MULTI_CPU:
        _shard_on_cpu(acc)
    return acc


# cuDNN's attention backward failed on the first H100 run (torch 2.11.0+cu130, FLUX at
# full size, 256 px, gradient checkpointing): "mha_graph.execute(...).is_good()" in the
# backward, then an illegal memory access. With it off, SDPA takes the flash or
# memory-efficient kernel and the same iteration ran. Set this variable to 1 to keep it.
KEEP_CUDNN_ATTENTION = "DIFFRL_CUDNN_ATTENTION"


def avoid_cudnn_attention(log=print) -> bool:
    """Turn PyTorch's cuDNN SDPA backend off for training on a CUDA device (see
    ``KEEP_CUDNN_ATTENTION``); True when it was turned off here."""
    if os.environ.get(KEEP_CUDNN_ATTENTION) == "1" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    if torch.cuda.is_available():
        log(f"attention: cuDNN SDPA off (its backward failed on H100; {KEEP_CUDNN_ATTENTION}=1 keeps it)")
    return True


# What `accelerate launch --use_fsdp` (FSDP2, one unit per transformer block) sets: for
# launching with torchrun, as the GPU suite and the multi-process tests do.
FSDP_LAUNCH_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
}


def fsdp_requested() -> bool:
    """Whether the launch asked for FSDP (``accelerate launch --use_fsdp`` or an accelerate
    config with ``distributed_type: FSDP`` set this variable)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _shard_on_cpu(acc: Accelerator) -> None:
    """accelerate (1.15) turns FSDP on only for accelerator devices and runs several CPU
    processes as DDP over gloo even when FSDP was asked for. torch shards on CPU with
    gloo, so switch the shared state to FSDP with the plugin the launch configured
    (read from the FSDP_* variables): CPU runs, CI's included, then take the same sharded
    path as GPU runs."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    state = AcceleratorState()
    plugin = FullyShardedDataParallelPlugin()
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
    # a later AcceleratorState() re-reads the process state: keep the two in agreement
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def make_lr_scheduler(optimizer, cfg: Config, total_steps: int):
    warmup, kind = cfg.optim.warmup_steps, cfg.optim.scheduler

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, total_steps - warmup))
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if kind == "linear":
            return 1.0 - progress
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
