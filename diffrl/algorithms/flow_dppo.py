"""Flow-DPPO: a divergence mask instead of a ratio clip (Ping et al. 2026, "Flow-DPPO:
Divergence Proximal Policy Optimization for Flow Matching Models", arXiv 2606.11025,
Eq. 14 and 18).

Per trained transition x_t -> x_{t+1} of sample i, with the old (rollout) and new
Gaussian transitions sharing their std s:

    D = mean_d (mu_theta - mu_old)^2 / (2 s^2)                 (Eq. 14, per dimension)
    drop = D >= tau  and  ((rho > 1 and A > 0) or (rho < 1 and A < 0))   (Eq. 18)
    L = mean_i( -A rho [not drop] )

The mask (detached) removes a transition's gradient once the policy has moved more
than ``objective.args.kl_threshold`` (tau) away from the rollout *and* the ratio keeps
moving the way the advantage pushes it; moves back toward the old policy stay. Unlike
the PPO clip, the trust region is measured by the divergence of the two transitions,
not by the ratio of one sampled point, which the paper argues is the noisy quantity that
lets the clip be bypassed (reward hacking).

Reference: Tencent-Hunyuan/UniRL, ``unirl/algorithms/flowdppo.py``
(``_flowdppo_kl_adv_loss``, ``_gaussian_kl_div``), whose D is the per-dimension mean
(the paper writes the sum; tau = 1e-5 is calibrated to the mean). Deliberate choices:
s is the transition's true std (UniRL's ``add_kl_coefficient: true``; with false it
sets s = 1); advantages are not clipped (UniRL and verl-omni do not clip them); a
reference KL (``kl_coef``) is added as in flow-GRPO. Supports independent rollouts,
trees (per edge) and Sol-RL's regenerated subsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.algorithms.flow_grpo import reference_kl, rescored
from diffrl.algorithms.objective import (
    LossContext,
    Objective,
    StepBatch,
    add_penalty,
    masked_mean,
    register_objective,
)
from diffrl.sampling.sde import gaussian_kl
from diffrl.schema import ConfigError, setting


@dataclass(frozen=True)
class FlowDppoArgs:
    """Flow-DPPO's parameter (``objective.args``)."""

    kl_threshold: float = setting(
        1e-5,
        "A transition whose per-dimension KL(old || new) reaches this is masked when its ratio "
        "moves further in the advantage's direction.",
    )

    def check(self) -> None:
        if not self.kl_threshold > 0:
            raise ConfigError(f"objective.args.kl_threshold must be > 0, got {self.kl_threshold}")


def divergence_mask(divergence, ratio, advantages, threshold: float) -> torch.Tensor:
    """(B,) bool, True where the transition keeps its gradient (Eq. 18 negated)."""
    outside = divergence >= threshold
    further = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
    return ~(outside & further)


def flow_dppo_loss(ctx: LossContext, batch: StepBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked policy-gradient loss (+ reference KL) for one step of a micro-batch."""
    ocfg = ctx.objective_cfg
    if batch.old_mean is None:
        raise ValueError("flow_dppo needs the rollout's transition means (the updater provides them)")
    new, level = rescored(ctx, batch)
    log_ratio = new.log_prob - batch.old_log_prob
    ratio = torch.exp(log_ratio)
    divergence = gaussian_kl(new.mean.detach(), batch.old_mean, new.std, new.std_t, "exact", "mean")
    adv = batch.advantages
    keep = divergence_mask(divergence, ratio.detach(), adv, ocfg.args.kl_threshold)
    w = batch.weights
    # where, not a product: an overflowing ratio times a zero mask would be NaN
    policy_loss = masked_mean(torch.where(keep, -adv * ratio, torch.zeros_like(ratio)), w)
    stats = {
        "policy_loss": policy_loss.detach(),
        "approx_kl": masked_mean(0.5 * log_ratio.detach() ** 2, w),
        "dppo/masked": masked_mean((~keep).float(), w),
        "dppo/divergence": masked_mean(divergence, w),
        "ratio": masked_mean(ratio.detach(), w),
    }
    loss = policy_loss
    if ocfg.kl_coef > 0 and ctx.reference_velocity is not None:
        loss = add_penalty(loss, stats, "kl", reference_kl(ctx, batch, new, level), ocfg.kl_coef)
    stats["loss"] = loss.detach()
    return loss, stats


FLOW_DPPO = Objective("flow_dppo", flow_dppo_loss, trains_on="transitions", args=FlowDppoArgs)
register_objective(FLOW_DPPO)
