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


# below this a re-noising step keeps almost nothing of its noise: its std is the level
CONSISTENCY_MIN_SIGMA = 0.01


def check_consistency_grid(sigmas: torch.Tensor, kinds: list[str]) -> None:
    """Refuse a consistency step that re-noises to a level in (0, 0.01). The SD3-style
    schedulers' own grids end at sigma 1/1000 (diffusers' FlowMatchEulerDiscreteScheduler:
    timesteps down to 1), harmless to Euler but a consistency transition there has std
    0.001, so any change of the model moves its log-prob ratio by orders of magnitude (a
    ShapeWorld run measured 2-4 per optimizer step against a clip of 1e-4)."""
    levels = sigmas.tolist()
    tiny = [
        t for t, k in enumerate(kinds) if k == "consistency" and 0 < levels[t + 1] < CONSISTENCY_MIN_SIGMA
    ]
    if tiny:
        t = tiny[0]
        raise ValueError(
            f"sampling.sde_type consistency re-noises step {t} to sigma {levels[t + 1]:.4f}, which this "
            "model's scheduler puts just above 0: set sampling.sigma_shift (1.0 steps through "
            "linspace(1, 0, num_steps + 1); the model's own shift keeps its spacing)"
        )
