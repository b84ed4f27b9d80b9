"""The sigma grid a rollout steps through.

By default the pipeline scheduler's own grid (``adapter.sigmas``: shift or dynamic shift,
as each diffusers pipeline builds it). ``sampling.sigma_shift = s`` replaces it with
DanceGRPO's and BranchGRPO's fixed shift (``fastvideo/train_grpo_flux.py``:
``sd3_time_shift(shift, torch.linspace(1, 0, steps + 1))``): s t / (1 + (s - 1) t) over
t = linspace(1, 0, N + 1), the same at every resolution.
"""

from __future__ import annotations

import torch


def shifted_grid(num_steps: int, shift: float) -> torch.Tensor:
    """s t / (1 + (s - 1) t) over t = linspace(1, 0, N + 1), fp32: 1 down to 0."""
    t = torch.linspace(1, 0, num_steps + 1)
    return (shift * t) / (1 + (shift - 1) * t)


def sigma_grid(adapter, num_steps: int, shift: float | None = None) -> torch.Tensor:
    """``num_steps + 1`` fp32 sigmas: the fixed shift when given, else the pipeline's."""
    if shift is None:
        return adapter.sigmas(num_steps).float()
    return shifted_grid(num_steps, float(shift))
