"""Metrics: one JSON object per iteration in ``<run>/metrics.jsonl`` plus accelerate trackers."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from diffrl.evaluation.summary import read_metrics


def _plain(value):
    if isinstance(value, torch.Tensor):
        value = value.detach().float().mean().item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; null marks it
    return value


class MetricsLogger:
    def __init__(self, accelerator, run_dir: Path, resume_step: int = 0):
        self.accelerator = accelerator
        self.path = Path(run_dir) / "metrics.jsonl"
        self.start = time.time()
        if resume_step > 0 and self.path.exists():
            self.start -= self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> float:
        """After a resume, drop rows logged past the checkpoint (so the file has no
        duplicates) and return the wall time already spent, so wall_time stays cumulative."""
        rows = read_metrics(self.path, warn=self.accelerator.print)
        kept = [r for r in rows if r.get("step", 0) <= step]
        if self.accelerator.is_main_process:
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return float(kept[-1].get("wall_time", 0.0)) if kept else 0.0

    def log(self, step: int, metrics: dict) -> dict:
        row = {"step": step, "wall_time": time.time() - self.start}
        row.update({k: _plain(v) for k, v in metrics.items()})
        if self.accelerator.is_main_process:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        trackable = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        self.accelerator.log(trackable, step=step)
        return row
