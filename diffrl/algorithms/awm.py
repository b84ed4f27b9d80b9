"""Advantage Weighted Matching (Xue et al. 2025, "Advantage Weighted Matching: Aligning
RL with Pretraining in Diffusion Models", arXiv 2509.25050).

AWM trains with the pretraining loss itself, flow matching on the policy's own clean
samples, and lets the advantage decide the sign and size of each sample's pull. For a
clean sample x0 noised afresh, x_t = (1 - t) x0 + t eps, the per-sample error and its
surrogate log-likelihood are

    l = mean_d (v_theta(x_t, t) - (eps - x0))^2
    log p = -(t / p) ((l + 1e-10)^p - 1e-10^p)          (generalised Huber, p = 0.25;
                                                         p = 1 gives -t l)

and the loss is the policy gradient -A' * exp(log p - sg(log p)) (value -A', gradient
-A' grad log p) with A' = clip(A, -c, c) * a_max / c. The flow-matching error is a
variance-reduced score: AWM's point is that this has the same variance as pretraining,
where the likelihood ratio of flow-GRPO's SDE transitions does not, hence its reported
24-34x speed-up over Flow-GRPO. Two velocity penalties keep it near where it started:

    + kl_coef * mean (v_theta - v_ref)^2       (the base model, LoRA off)
    + ema_beta * mean (v_theta - v_ema)^2       (an EMA of the policy)

The EMA is the trainer's old policy (:class:`diffrl.training.ema.OldPolicy`), whose
decay min(old_decay_max, old_decay_rate * step) is AWM's
min(0.3, 0.001 * global_step) with ``objective.args.old_decay_max: 0.3``; it is checkpointed, so a
resumed run continues with the same anchor.

Reference: scxue/advantage_weighted_matching, ``scripts/train_sd3_awm.py``
(``compute_log_prob_awm``, the loss in ``main``). Deliberate deviations: the reference's
ratio clip (clip_range 1, ratio = 1 on-policy) is inert and left out; timesteps are the
sampler's grid narrowed by ``objective.forward_window`` rather than its stratified bins;
samples come from our sampler (the reference uses SA-Solver). Trains only on clean
samples, so it runs with any sampler, on a tree's leaves (grouped by tree) and on
Sol-RL's regenerated subsets.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    velocity_gap,
)
from diffrl.schema import ConfigError, setting


@dataclass(frozen=True)
class AwmArgs(OldPolicyArgs):
    """AWM's parameters (``objective.args``): its surrogate's power, the advantages' range,
    the EMA anchor's weight, and the EMA's decay schedule (:class:`OldPolicyArgs`; AWM's
    reference: rate 0.001, max 0.3)."""

    huber_power: float = setting(
        0.25,
        "Power p of the generalised-Huber surrogate log-likelihood -(t/p)((l+1e-10)^p - 1e-10^p) "
        "of the per-sample flow-matching error l; 1 gives -t l.",
    )
    advantage_max: float = setting(
        1.0, "Clipped advantages are rescaled from [-adv_clip_max, adv_clip_max] to this range."
    )
    ema_beta: float = setting(
        1.0, "Weight of mean ||v_theta - v_ema||^2, the EMA anchor (its schedule: old_decay_*)."
    )

    def check(self) -> None:
        super().check()
        for key in ("huber_power", "advantage_max"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"objective.args.{key} must be > 0, got {getattr(self, key)}")
        if self.ema_beta < 0:
            raise ConfigError(f"objective.args.ema_beta must be >= 0, got {self.ema_beta}")


def huber_log_likelihood(error: torch.Tensor, t: torch.Tensor, power: float) -> torch.Tensor:
    """AWM's surrogate log p of a per-sample flow-matching error (computed in float64,
    as the reference does, since (l + 1e-10)^0.25 of small l loses digits in fp32)."""
    tiny = torch.tensor(1e-10, dtype=torch.float64, device=error.device)
    shaped = (error.double() + tiny) ** power - tiny**power
    return (-(t.double() / power) * shaped).to(error.dtype)


def scaled_advantages(advantages: torch.Tensor, clip: float, advantage_max: float) -> torch.Tensor:
    return torch.clamp(advantages, -clip, clip) / clip * advantage_max


def awm_loss(ctx: LossContext, batch: StepBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantage-weighted flow matching for one forward-noised micro-batch."""
    if batch.x0 is None or batch.forward_noise is None:
        raise ValueError(
            "the awm objective needs clean latents and their forward noise (the updater provides both)"
        )
    ocfg = ctx.objective_cfg
    sigma_b = batch.sigma.expand(batch.x_t.shape[0])
    v_ema = None
    args = ocfg.args
    if args.ema_beta > 0 and ctx.old_velocity is not None:
        with torch.no_grad():  # first: the EMA is swapped into the live weights
            v_ema = ctx.old_velocity(batch.x_t, sigma_b, batch.cond).detach()
    v = ctx.policy_velocity(batch.x_t, sigma_b, batch.cond)
    target = (batch.forward_noise - batch.x0).to(v.dtype)
    error = per_sample_mean((v - target) ** 2)
    log_p = huber_log_likelihood(error, batch.sigma, args.huber_power)
    adv = scaled_advantages(batch.advantages.to(v.dtype), ocfg.adv_clip_max, args.advantage_max)
    w = batch.weights
    policy_loss = masked_mean(-adv * torch.exp(log_p - log_p.detach()), w)
    stats = {"policy_loss": policy_loss.detach(), "awm/fm_error": masked_mean(error.detach(), w)}
    loss = policy_loss
    if v_ema is not None:
        loss = add_penalty(loss, stats, "awm/ema_kl", velocity_gap(v, v_ema, w), args.ema_beta)
    if ocfg.kl_coef > 0 and ctx.reference_velocity is not None:
        loss = add_penalty(loss, stats, "kl", reference_velocity_gap(ctx, batch, v), ocfg.kl_coef)
    stats["loss"] = loss.detach()
    return loss, stats


AWM = Objective("awm", awm_loss, trains_on="clean_samples", needs_old_policy=True, args=AwmArgs)
register_objective(AWM)
