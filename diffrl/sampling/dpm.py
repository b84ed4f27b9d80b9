"""DPM-Solver++(2M) for the deterministic rollouts of DiffusionNFT's recipes.

DiffusionNFT samples its training rollouts with ``solver="dpm2"``
(``flow_grpo/diffusers_patch/solver.py``: ``dpm_step`` with order 2): multistep
DPM-Solver++ in data prediction (Lu et al. 2022, "DPM-Solver++", Alg. 2, the midpoint
form), with the flow-matching schedule alpha = 1 - sigma, sigma = sigma. Per step, with
the clean-sample prediction x0 = x - sigma v and lambda = log(alpha / sigma):

    h  = lambda_next - lambda_t,   h0 = lambda_t - lambda_prev,   r = h0 / h
    D0 = x0_t,                     D1 = (x0_t - x0_prev) / r
    x_next = (sigma_next / sigma_t) x - alpha_next (e^-h - 1) D0 - 0.5 alpha_next (e^-h - 1) D1

The first step (no previous prediction) and the last (sigma_next = 0) are first-order:
the DDIM step with eta 0, which for flow matching is the Euler step x + (sigma_next -
sigma_t) v exactly. As the reference, the update is computed in float64. At sigma = 1
(alpha = 0, lambda = -inf) r is infinite and D1 vanishes: the second step of a grid
starting at 1 is first-order too, in the reference as here.
"""

from __future__ import annotations

import torch


def euler(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """The first-order step (DDIM with eta 0 is this step for flow matching)."""
    return x + (sigma_next - sigma) * v


def dpm2_step(
    x: torch.Tensor,
    x0: torch.Tensor,
    x0_prev: torch.Tensor,
    sigma_prev: float,
    sigma: float,
    sigma_next: float,
) -> torch.Tensor:
    """One multistep DPM-Solver++(2M) update from ``x`` at ``sigma`` to ``sigma_next``,
    given this step's and the previous step's clean-sample predictions."""
    s_prev, s, s_next = (torch.tensor(float(v), dtype=torch.float64) for v in (sigma_prev, sigma, sigma_next))
    lam = lambda sig: torch.log(1 - sig) - torch.log(sig)  # noqa: E731
    h, h0 = lam(s_next) - lam(s), lam(s) - lam(s_prev)
    r = h0 / h
    x64, d0 = x.double(), x0.double()
    d1 = (1.0 / r) * (d0 - x0_prev.double())
    coef = (1 - s_next) * (torch.exp(-h) - 1.0)
    out = (s_next / s) * x64 - coef * d0 - 0.5 * coef * d1
    return out.to(x.dtype)


class DPM2:
    """The solver's state along one batch of paths: the previous clean prediction."""

    def __init__(self, num_steps: int):
        self.num_steps, self.prev = num_steps, None

    def step(self, t: int, x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
        x0 = x - sigma * v
        first_order = self.prev is None or t == self.num_steps - 1
        out = (
            euler(x, v, sigma, sigma_next) if first_order else dpm2_step(x, x0, *self.prev, sigma, sigma_next)
        )
        self.prev = (x0, sigma)
        return out
