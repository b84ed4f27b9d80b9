"""One reverse step of a flow-matching sampler, with the Gaussian log-prob of the step.

Convention (diffusers flow matching): x_sigma = (1 - sigma) x0 + sigma x1, with sigma = 1
pure noise, velocity v = x1 - x0, and dt = sigma_next - sigma < 0. Everything here runs
in fp32. Four step rules:

* ``sde`` — Flow-GRPO (Liu et al. 2025, Eq. 9-10). std_t = a sqrt(sigma / (1 - sigma)),
  with 1 - sigma replaced by 1 - sigma_1 on the grid's first step (flow_grpo does it at
  sigma = 1; see ``step_mean_std``);
  mean = x + [v + std_t^2 / (2 sigma) (x + (1 - sigma) v)] dt; x' = mean + std_t sqrt(-dt) eps.
* ``cps`` — coefficient-preserving sampling: std = sigma_next sin(a pi / 2);
  mean = x0_hat (1 - sigma_next) + x1_hat sqrt(sigma_next^2 - std^2).
* ``dance`` — DanceGRPO: constant eta, std = eta sqrt(-dt);
  mean = x + dt (v - eta^2 / 2 * score), score = -(x - (1 - sigma) x0_hat) / sigma^2.
* ``consistency`` — multistep consistency sampling (Song et al. 2023, "Consistency
  Models", Algorithm 1; the MDP of RLCM, Oertell et al. 2024, Sec. 4): predict the clean
  sample x0_hat = x - sigma v, then re-noise it to the next level with fresh noise,
  x' = (1 - sigma_next) x0_hat + sigma_next eps: mean = (1 - sigma_next) x0_hat,
  std = sigma_next (the noise level does not enter). The flow-matching form of RLCM's
  LCM step (Owen-Oertell/rlcm, ``diffusers_patch/lcm_scheduler.py``: x' = sqrt(abar')
  denoised + sqrt(1 - abar') z), and cps at a = 1. The last step (sigma_next = 0) returns
  x0_hat itself, deterministic and untrained; RLCM's code re-noises after it too, to the
  last level, and trains on that draw, which the decoded image does not depend on (its
  gradient is zero in expectation): that transition is not taken here.
* ``ode`` — Euler: x' = x + v dt (deterministic, not trainable).

Log-prob reduction: the per-element Gaussian log-density is reduced over all non-batch
dims by ``mean`` (default, as flow_grpo and DanceGRPO do: the ratio exp(dlogp) then does
not scale with resolution, so one clip range works across model sizes) or by ``sum``
(the true log-density of the transition). ``flow_grpo`` is flow_grpo's own convention
(yifan123/flow_grpo, ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``): ``mean``
for every rule except ``cps``, whose reference log-prob is -mean((x' - mean)^2), without
the 1 / (2 std^2) and the constants. A log-ratio under it is the density's times 2 std^2
(1.46, 0.58 and 1.3e-4 at steps 0, 5 and 8 of a 10-step shift-3 schedule at a = 0.7), so
one clip range is a much looser constraint late in the schedule than under ``mean``.
Steps whose std is 0 have log-prob 0 and are marked untrainable by the rollout, under
every convention (flow_grpo would still score the last cps step, whose std is 0).

References: the ``sde`` and ``cps`` steps and the ``flow_grpo`` KL follow
yifan123/flow_grpo (``sd3_sde_with_logprob.py``, ``scripts/train_sd3.py``), ``dance``
follows XueZeyue/DanceGRPO (``fastvideo/train_grpo_flux.py: flux_step``); tests compare
them with the reference code's outputs (``tests/fixtures/reference``). Deliberate
deviation: the sde step's first-step rule (``step_mean_std``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STEP_KINDS = ("sde", "cps", "dance", "consistency", "ode")
LOGPROB_REDUCTIONS = ("mean", "sum", "flow_grpo")


@dataclass
class StepResult:
    next_latents: torch.Tensor  # x_{t+1}: sampled, or the given one when scoring
    mean: torch.Tensor  # mean of the Gaussian transition (same shape as latents)
    std: torch.Tensor  # (B,) std of the transition (std_t * sqrt(-dt) for sde)
    std_t: torch.Tensor  # (B,) the step rule's own noise scale (flow_grpo's KL divides by it)
    log_prob: torch.Tensor  # (B,) reduced Gaussian log-density of next_latents


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape(-1, *([1] * (like.ndim - 1)))


def _as_batch(v, batch: int, device) -> torch.Tensor:
    v = torch.as_tensor(v, dtype=torch.float32, device=device)
    return v.expand(batch) if v.ndim == 0 else v.float()


def step_mean_std(
    kind: str,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    sigma_1: float | None = None,
):
    """Mean (shape of x), transition std (B,) and rule std_t (B,) of one reverse step."""
    x, v = x.float(), v.float()
    b = x.shape[0]
    s, s_next = _as_batch(sigma, b, x.device), _as_batch(sigma_next, b, x.device)
    dt = s_next - s
    sb, dtb = _bcast(s, x), _bcast(dt, x)
    if kind == "ode":
        zero = torch.zeros_like(s)
        return x + v * dtb, zero, zero
    if kind == "sde":
        # flow_grpo (sd3_sde_with_logprob) uses 1 - sigma_1 where sigma = 1, which would divide
        # by zero. DPM-Solver / UniPC grids (SANA, Wan) start just below 1 (0.9997, 0.999999),
        # where 1 - sigma is as harmful (std_t 55x, 1000x a); "above sigma_1" is the first step
        # of any decreasing grid, and is exactly "sigma = 1" on the FLUX / SD3 grids.
        first = s >= 1.0 if sigma_1 is None else s > sigma_1
        denom_sigma = torch.where(first, torch.full_like(s, sigma_1 if sigma_1 is not None else 0.0), s)
        std_t = noise_level * torch.sqrt(s / (1.0 - denom_sigma))
        stb = _bcast(std_t, x)
        mean = x + (v + stb**2 / (2 * sb) * (x + (1 - sb) * v)) * dtb
        return mean, std_t * torch.sqrt(-dt), std_t
    if kind == "cps":
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0, x1 = x - sb * v, x + (1 - sb) * v
        coef = torch.sqrt(torch.clamp(s_next**2 - std**2, min=0.0))
        mean = x0 * _bcast(1 - s_next, x) + x1 * _bcast(coef, x)
        return mean, std, std
    if kind == "consistency":
        x0 = x - sb * v
        return x0 * _bcast(1 - s_next, x), s_next.clone(), s_next.clone()
    if kind == "dance":
        x0 = x - sb * v
        score = -(x - (1 - sb) * x0) / sb**2
        mean = x + dtb * (v - 0.5 * noise_level**2 * score)
        return mean, noise_level * torch.sqrt(-dt), torch.full_like(s, noise_level)
    raise ValueError(f"unknown step kind '{kind}'; valid: {', '.join(STEP_KINDS)}")


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean"):
    """Log N(x; mean, std^2) per element, reduced over non-batch dims. std (B,) > 0."""
    stb = _bcast(std, x)
    if reduction not in LOGPROB_REDUCTIONS:
        raise ValueError(
            f"logprob reduction must be one of {', '.join(LOGPROB_REDUCTIONS)}, got '{reduction}'"
        )
    elem = -((x - mean) ** 2) / (2 * stb**2) - torch.log(stb) - 0.5 * math.log(2 * math.pi)
    dims = tuple(range(1, x.ndim))
    return elem.sum(dim=dims) if reduction == "sum" else elem.mean(dim=dims)


def step_log_prob(kind: str, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean"):
    """The step's log-prob under ``reduction`` (see the module docstring for ``flow_grpo``)."""
    if reduction == "flow_grpo" and kind == "cps":
        return -((x - mean) ** 2).mean(dim=tuple(range(1, x.ndim)))
    return gaussian_log_prob(x, mean, std, reduction)


def step(
    kind: str,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    *,
    sigma_1: float | None = None,
    noise: torch.Tensor | None = None,
    next_latents: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepResult:
    """Take (``noise`` given) or score (``next_latents`` given) one reverse step.

    Exactly one of ``noise`` / ``next_latents`` may be given; with neither, the step is
    taken with zero noise (the mean). The returned log-prob is of ``next_latents``.
    """
    mean, std, std_t = step_mean_std(kind, x, v, sigma, sigma_next, noise_level, sigma_1)
    if next_latents is None:
        next_latents = mean if noise is None else mean + _bcast(std, mean) * noise.to(mean)
    next_latents = next_latents.float()
    # Deterministic rows (std 0) have no density; they get log-prob 0 so they drop out of
    # ratios. Decided without reading the device: every row is scored with std 1 standing
    # in for 0 (finite values, so the gradient through the masked rows is an exact 0), and
    # the mask picks. Rows with std > 0 get exactly the log-prob they had alone.
    safe = std > 0
    scored = step_log_prob(kind, next_latents.detach(), mean, torch.where(safe, std, 1.0), reduction)
    log_prob = torch.where(safe, scored, torch.zeros_like(scored))
    return StepResult(next_latents, mean, std, std_t, log_prob)


def gaussian_kl(
    mean_p: torch.Tensor,
    mean_q: torch.Tensor,
    std: torch.Tensor,
    std_t: torch.Tensor,
    kind: str = "exact",
    reduction: str = "mean",
) -> torch.Tensor:
    """KL between two Gaussian transitions that share their std, per sample (B,).

    ``exact``: ||mu_p - mu_q||^2 / (2 std^2) with std the transition std (std_t sqrt(-dt)
    for the Flow-GRPO SDE). ``flow_grpo``: divides by 2 std_t^2 instead, as the
    flow_grpo reference code does (smaller by a factor -dt). Summed under the ``sum``
    reduction, else averaged (flow_grpo averages).
    """
    denom = std if kind == "exact" else std_t
    if kind not in ("exact", "flow_grpo"):
        raise ValueError(f"kl_type must be 'exact' or 'flow_grpo', got '{kind}'")
    sq = (mean_p.float() - mean_q.float()) ** 2 / (2 * _bcast(denom, mean_p) ** 2)
    dims = tuple(range(1, mean_p.ndim))
    return sq.sum(dim=dims) if reduction == "sum" else sq.mean(dim=dims)
