"""The DiffusionNFT objective (Zheng et al. 2025, "DiffusionNFT: Online Diffusion
Reinforcement with Forward Process", Sec. 3: negative-aware fine-tuning).

Training uses the *forward* process only: a clean final latent x0 of a sample is
noised afresh, x_t = (1 - t) x0 + t eps, and the policy velocity v_theta is contrasted
with the old policy's v_old through two implicit policies

    v+ = beta v_theta + (1 - beta) v_old          (the positive policy)
    v- = (1 + beta) v_old - beta v_theta          (the implicit negative policy)

Each is turned into an x0 prediction x0_hat = x_t - t v and regressed onto x0 with
the adaptive weight of the reference implementation, 1 / mean|x0_hat - x0| (no
gradient, floored at 1e-5):

    L = c / beta * mean_i[ r_i L+_i + (1 - r_i) L-_i ]

with the optimality probability r = clip(clip(A, -c, c) / (2c) + 1/2, 0, 1) from the
group advantage A and c = ``objective.adv_clip_max``. A sample with r = 1 pulls the
policy toward itself, one with r = 0 pushes it away, and no likelihood, solver or
trajectory is needed: only x0. With ``kl_coef`` > 0 the velocity-space penalty
kl_coef * mean ||v_theta - v_ref||^2 is added.

The old policy is an EMA of the trained weights refreshed once per iteration
(:class:`diffrl.training.ema.OldPolicy`): decay 0 makes it the policy that sampled.

Reference: NVlabs/DiffusionNFT, ``scripts/train_nft_sd3.py`` (loss lines 864-970,
``return_decay``). The loss, r, the adaptive weight, the KL term and the old-policy
schedule (in optimizer steps) match its outputs to fp32 rounding
(tests/test_reference_parity.py). Deliberate deviations, each one setting away from the
reference:

* the reference samples rollouts with the old (EMA) weights; we sample with the trained
  ones unless ``objective.args.sample_with: old`` (they agree while the decay is 0);
* zero-variance groups (all rewards equal, r = 1/2) are dropped by our default
  ``advantage.filter_zero_std: true``; the reference keeps them, where they pull
  v_theta toward v_old (set it false to match);
* the reference uses per-prompt mean and the std of all rewards (our ``global_std``
  estimator), our default estimator is ``group``; its ``kl_coef`` is 1e-4, ours 0;
* timesteps: the same grid (the sampler's sigmas) and the same count, int(fraction * N);
  the reference draws a subset per sample and mixes sigmas within a forward, we draw one
  subset per micro-batch so a forward has one sigma (the same distribution);
* with CFG (guidance > 1) we train the guided velocity (``objective.train_cfg``); the
  reference's NFT configs sample without CFG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from diffrl.algorithms.objective import (
    LossContext,
    Objective,
    OldPolicyArgs,
    StepBatch,
    add_penalty,
    masked_mean,
    per_sample_mean,
    reference_velocity_gap,
    register_objective,
)
from diffrl.schema import ConfigError, setting


@dataclass(frozen=True)
class NftArgs(OldPolicyArgs):
    """DiffusionNFT's parameters (``objective.args``): the step of its implicit policies,
    which weights roll out, and its old policy's decay (:class:`OldPolicyArgs`)."""

    beta: float = setting(1.0, "Step size beta of the implicit positive/negative policies.")
    sample_with: Literal["current", "old"] = setting(
        "current",
        "Roll out with the trained weights ('current') or with the old policy's ('old', as the "
        "reference and Sol-RL's train_sana.py do; with Sol-RL both the exploration copy and the "
        "regeneration then sample with the old policy).",
    )

    def check(self) -> None:
        super().check()
        if self.beta <= 0:
            raise ConfigError(f"objective.args.beta must be > 0, got {self.beta}")


def _adaptive_x0_loss(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        weight = per_sample_mean((x0_hat.double() - x0.double()).abs()).clamp(min=1e-5)
    return per_sample_mean((x0_hat - x0) ** 2) / weight.to(x0_hat.dtype)


def optimality_probability(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """r in [0, 1]: 1/2 at zero advantage, 1 at +clip, 0 at -clip."""
    return (torch.clamp(advantages, -clip, clip) / clip / 2 + 0.5).clamp(0, 1)


def nft_loss(ctx: LossContext, batch: StepBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative-aware loss for one forward-noised micro-batch; ``batch.x_t`` is
    (1 - sigma) x0 + sigma eps and ``batch.x0`` the clean latents."""
    if batch.x0 is None or ctx.old_velocity is None:
        raise ValueError(
            "the nft objective needs clean latents and an old policy (the updater provides both)"
        )
    ocfg = ctx.objective_cfg
    beta, clip = ocfg.args.beta, ocfg.adv_clip_max
    b = batch.x_t.shape[0]
    sigma_b = batch.sigma.expand(b)
    t = batch.sigma.reshape(1, *[1] * (batch.x_t.dim() - 1))
    with torch.no_grad():  # first: the old policy may be swapped into the live weights
        v_old = ctx.old_velocity(batch.x_t, sigma_b, batch.cond).detach()
    v = ctx.policy_velocity(batch.x_t, sigma_b, batch.cond)
    positive = beta * v + (1 - beta) * v_old
    negative = (1 + beta) * v_old - beta * v
    x0 = batch.x0.to(v.dtype)
    loss_pos = _adaptive_x0_loss(batch.x_t - t * positive, x0)
    loss_neg = _adaptive_x0_loss(batch.x_t - t * negative, x0)
    r = optimality_probability(batch.advantages.to(v.dtype), clip)
    w = batch.weights
    policy_loss = masked_mean((r * loss_pos + (1 - r) * loss_neg) * clip / beta, w)
    stats = {
        "policy_loss": policy_loss.detach(),
        "nft/positive_loss": masked_mean(loss_pos.detach(), w),
        "nft/negative_loss": masked_mean(loss_neg.detach(), w),
        "nft/r": masked_mean(r.detach(), w),
    }
    loss = policy_loss
    if ocfg.kl_coef > 0 and ctx.reference_velocity is not None:
        loss = add_penalty(loss, stats, "kl", reference_velocity_gap(ctx, batch, v), ocfg.kl_coef)
    stats["loss"] = loss.detach()
    return loss, stats


NFT = Objective("nft", nft_loss, trains_on="clean_samples", needs_old_policy=True, args=NftArgs)
register_objective(NFT)
