"""What a run starts with besides the model: the accelerator (with the trackers that are
actually installed) and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from diffrl.config import Config


def make_accelerator(cfg: Config) -> Accelerator:
    project = ProjectConfiguration(project_dir=str(cfg.run_dir), logging_dir=str(cfg.run_dir / "logs"))
    trackers = installed_trackers(cfg.logging.trackers) or None
    return Accelerator(mixed_precision=cfg.train.mixed_precision, log_with=trackers, project_config=project)


def installed_trackers(names: list[str], log=print) -> list[str]:
    """The configured trackers whose package is installed; each missing one is a note
    (metrics.jsonl is written in any case), not a crash mid-start."""
    import importlib.util

    kept = []
    for name in names:  # accelerate's tracker names are their packages' import names
        if importlib.util.find_spec(name) is None:
            log(
                f"note: logging.trackers names '{name}' but it is not installed (pip install {name}); "
                "logging to metrics.jsonl only for it"
            )
        else:
            kept.append(name)
    return kept


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
