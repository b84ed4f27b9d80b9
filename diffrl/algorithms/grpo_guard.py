"""GRPO-Guard: flow-GRPO with a normalised ratio (Wang et al. 2025, "GRPO-Guard:
Mitigating Implicit Over-Optimization in Flow Matching via Regulated Clipping",
arXiv 2510.22319, "RatioNorm" and its gradient reweighting).

Why: for a Gaussian SDE transition x' = mu_old + s eps (s the step's std), the log-ratio
of the mean-reduced densities is

    log r = mean(eps * d) / s - mean(d^2) / (2 s^2),        d = mu_theta - mu_old,

whose second term is always negative and grows as s shrinks (the low-noise steps). The
ratio's distribution is then shifted below 1 and its spread depends on the step, so the
PPO clip stops bounding updates where the ratio drifts upward (the paper's implicit
over-optimisation). RatioNorm removes the bias and the 1/s scale:

    log rho = s * log r + mean(d^2) / (2 s) = mean(eps * d),

zero-mean at every step, and clips rho with the usual max(-A rho, -A clip(rho, 1 +- e)).
The loss of a step is divided by |dt| (= (sqrt(-dt))^2) to even out the steps'
gradient scales. Because log rho is small, ``objective.clip_range`` must be small too
(verl-omni uses 2e-6, Flow-Factory 1e-4).

Reference code: the paper's is not released; this follows verl-omni
(``verl_omni/trainer/diffusion/diffusion_algos.py``, ``GRPOGuardLoss``), including the
1/|dt| factor; Flow-Factory's ``GRPOGuardTrainer`` uses the same ratio without it.
The identity log rho = mean(eps * d) is tested against the formula
(tests/algorithms/test_new_objectives.py). Needs ``objective.logprob_reduction: mean``
(the identity holds for the mean-reduced true density). Works wherever flow-GRPO does:
independent rollouts, trees and Sol-RL's regenerated subsets.
"""

from __future__ import annotations

from functools import partial

from diffrl.algorithms.flow_grpo import flow_grpo_loss, normalized_log_ratio
from diffrl.algorithms.objective import Objective, register_objective

__all__ = ["GRPO_GUARD", "normalized_log_ratio"]


GRPO_GUARD = Objective("grpo_guard", partial(flow_grpo_loss, ratio_norm=True), trains_on="transitions")
register_objective(GRPO_GUARD)
