"""SDE windows: which denoising steps are stochastic (and so trainable) at an iteration.

MixGRPO (Li et al. 2025) and BranchGRPO-Mix run the SDE only inside a window of
consecutive steps and the ODE elsewhere; only window steps carry a log-prob ratio, so
only they are trained. Three placements of the window [start, end):

* fixed: ``sampling.sde_window`` as written;
* sliding (MixGRPO): with ``sde_window_slide_every = k > 0`` the window moves
  ``sde_window_slide_stride`` steps later every k iterations, and stops when it reaches
  the last step (it never shrinks);
* random (Flow-GRPO-Fast): with ``sde_window_range = [lo, hi]`` each iteration draws the
  start uniformly from lo .. hi - size (both ends included; size = end - start of
  ``sde_window``), as flow_grpo's ``sd3_pipeline_with_logprob_fast.py`` does with
  ``random.randint(range[0], range[1] - sde_window_size)``. flow_grpo draws once per
  sampling batch of each GPU; here one draw per iteration, from (seed, iteration), holds
  for every sample of the iteration on every process (a trajectory has one step rule per
  step, and the update batches samples across steps).

References: MixGRPO (its sliding window), flow_grpo's Flow-GRPO-Fast (the random one);
the window arithmetic is ours and documented here, not copied.
"""

from __future__ import annotations

import torch

from diffrl.sampling import rng


def sde_window_at(sampling_cfg, num_steps: int, iteration: int = 0, seed: int = 0) -> tuple[int, int]:
    """The [start, end) SDE window at training ``iteration`` (the whole schedule if unset)."""
    window = sampling_cfg.sde_window
    if window is None:
        return 0, num_steps
    start, end = int(window[0]), int(window[1])
    size = end - start
    placement = getattr(sampling_cfg, "sde_window_range", None)
    if placement is not None:
        lo, hi = int(placement[0]), min(int(placement[1]), num_steps)
        draw = rng.generator(seed, iteration, "sde_window")
        start = lo + int(torch.randint(hi - size - lo + 1, (1,), generator=draw).item())
        return start, start + size
    every = sampling_cfg.sde_window_slide_every
    if every > 0:
        start = min(start + (iteration // every) * sampling_cfg.sde_window_slide_stride, num_steps - size)
        end = start + size
    return start, end


def step_kinds(sampling_cfg, num_steps: int, iteration: int = 0, always_sde=(), seed: int = 0) -> list[str]:
    """The step rule per step: the configured SDE inside the window (and at the steps in
    ``always_sde``, e.g. tree splits, which need noise to branch), the ODE elsewhere."""
    start, end = sde_window_at(sampling_cfg, num_steps, iteration, seed)
    sde = sampling_cfg.sde_type
    kinds = [sde if start <= t < end or t in always_sde else "ode" for t in range(num_steps)]
    return last_step_deterministic(kinds)


def last_step_deterministic(kinds: list[str]) -> list[str]:
    """Consistency sampling's last step lands on sigma 0 and returns the predicted clean
    sample, x - sigma v, which is the Euler step there: it is marked ``ode`` (no noise, no
    log-prob, not trained), so plans and trainable steps count it as what it is."""
    if kinds and kinds[-1] == "consistency":
        return [*kinds[:-1], "ode"]
    return kinds
