"""Timing the stages of an iteration (rollout, reward, update; Sol-RL's explore, select,
regenerate): what the loop logs as ``time/<stage>`` and, on CUDA, ``memory/<stage>_peak_gib``."""

from __future__ import annotations

import contextlib
import time

import torch


class StageClock:
    """Wall time of named stages and, on CUDA, each stage's peak allocated memory:
    ``time/<stage>`` and ``memory/<stage>_peak_gib``."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        yield
        if self.cuda:
            torch.cuda.synchronize()
            self.metrics[f"memory/{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self.metrics[f"time/{name}"] = time.time() - t0
