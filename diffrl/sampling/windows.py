"""SDE windows: which denoising steps are stochastic (and so trainable) at an iteration.

MixGRPO (Li et al. 2025) and BranchGRPO-Mix run the SDE only inside a window of
consecutive steps and the ODE elsewhere; only window steps carry a log-prob ratio, so
only they are trained. flow_grpo-Fast is the static case (a fixed early window). With
``sde_window_slide_every = k > 0`` the window moves ``sde_window_slide_stride`` steps
later every k iterations, and stops when it reaches the last step (it never shrinks).

References: MixGRPO (its sliding window), flow_grpo's Flow-GRPO-Fast (a fixed window);
the window arithmetic is ours and documented here, not copied.
"""

from __future__ import annotations


def sde_window_at(sampling_cfg, num_steps: int, iteration: int = 0) -> tuple[int, int]:
    """The [start, end) SDE window at training ``iteration`` (the whole schedule if unset)."""
    window = sampling_cfg.sde_window
    if window is None:
        return 0, num_steps
    start, end = int(window[0]), int(window[1])
    every = sampling_cfg.sde_window_slide_every
    if every > 0:
        size = end - start
        start = min(start + (iteration // every) * sampling_cfg.sde_window_slide_stride, num_steps - size)
        end = start + size
    return start, end


def step_kinds(sampling_cfg, num_steps: int, iteration: int = 0, always_sde=()) -> list[str]:
    """The step rule per step: the configured SDE inside the window (and at the steps in
    ``always_sde``, e.g. tree splits, which need noise to branch), the ODE elsewhere."""
    start, end = sde_window_at(sampling_cfg, num_steps, iteration)
    sde = sampling_cfg.sde_type
    return [sde if start <= t < end or t in always_sde else "ode" for t in range(num_steps)]
