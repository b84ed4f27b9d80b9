"""The Flow-GRPO objective (Liu et al. 2025, "Flow-GRPO", Eq. 6 and 11).

Per trained denoising step t and sample i:

    ratio = exp(log p_theta(x_{t+1} | x_t) - log p_old(x_{t+1} | x_t))
    L_clip = max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps))        (PPO, Schulman 2017)
    L = mean(L_clip) + beta * KL(p_theta || p_ref)

A is clipped to [-adv_clip_max, adv_clip_max]. The KL between the two Gaussian
transitions with equal std is ||mu_theta - mu_ref||^2 / (2 std^2) (``exact``), or
flow_grpo's variant dividing by std_t^2 (``flow_grpo``); see ``diffrl.sampling.sde``.

Reference: yifan123/flow_grpo, ``scripts/train_sd3.py`` (the clipped loss, the KL as
``mean((mu - mu_ref)^2) / (2 std_dev_t^2)``, ``num_train_timesteps = int(num_steps *
timestep_fraction)``), with ``sd3_sde_with_logprob.py`` for the step and its log-prob
(tests/test_reference_parity.py compares with outputs of that code). Deliberate
deviations: ``kl_type: exact`` (default) is the true Gaussian KL, 1 / (-dt) times
flow_grpo's, so reference hyper-parameters need ``kl_type: flow_grpo``
(configs/sd35_flowgrpo.yaml); the log-prob convention is the true density unless
``logprob_reduction: flow_grpo`` (which differs for ``cps`` only).
"""

from __future__ import annotations

import torch

from diffrl.algorithms.objective import (
    LossContext,
    Objective,
    StepBatch,
    add_penalty,
    masked_mean,
    register_objective,
)
from diffrl.sampling.sde import gaussian_kl, step


def _rescore(batch: StepBatch, v: torch.Tensor, level: float, reduction: str):
    """The stored transition x_t -> x_next scored under velocity ``v`` (policy or reference)."""
    return step(
        batch.kind,
        batch.x_t,
        v,
        batch.sigma,
        batch.sigma_next,
        level,
        sigma_1=batch.sigma_1,
        next_latents=batch.x_next,
        reduction=reduction,
    )


def reference_kl(ctx: LossContext, batch: StepBatch, new, level: float) -> torch.Tensor:
    """KL(p_theta || p_ref) of the batch's transitions, masked mean (B rows -> scalar)."""
    ocfg = ctx.objective_cfg
    with torch.no_grad():
        v_ref = ctx.reference_velocity(batch.x_t, batch.sigma.expand(batch.x_t.shape[0]), batch.cond)
    ref = _rescore(batch, v_ref, level, ocfg.logprob_reduction)
    per_row = gaussian_kl(
        new.mean, ref.mean.detach(), new.std, new.std_t, ocfg.kl_type, ocfg.logprob_reduction
    )
    return masked_mean(per_row, batch.weights)


def rescored(ctx: LossContext, batch: StepBatch):
    """The stored transitions scored under the policy's velocity (with grad), and the
    step rule's noise level they were drawn with."""
    level = ctx.noise_level if batch.noise_level is None else batch.noise_level
    v = ctx.policy_velocity(batch.x_t, batch.sigma.expand(batch.x_t.shape[0]), batch.cond)
    return _rescore(batch, v, level, ctx.objective_cfg.logprob_reduction), level


def normalized_log_ratio(
    log_ratio: torch.Tensor, new_mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """(B,) GRPO-Guard's log rho = s log r + mean((mu_theta - mu_old)^2) / (2 s)
    (:mod:`diffrl.algorithms.grpo_guard` derives it); flow-GRPO's loss takes it in place
    of log r when ``ratio_norm`` is on."""
    if old_mean is None:
        raise ValueError("grpo_guard needs the rollout's transition means (the updater provides them)")
    s = std.to(log_ratio.dtype)
    shift = (new_mean.float() - old_mean.float()).pow(2).flatten(1).mean(1)
    return s * log_ratio + shift / (2 * s)


def flow_grpo_loss(
    ctx: LossContext, batch: StepBatch, ratio_norm: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-ratio loss (+ KL) for one step of a micro-batch; returns (loss, stats).
    ``ratio_norm``: GRPO-Guard's normalised ratio and 1/|dt| weighting
    (:mod:`diffrl.algorithms.grpo_guard`)."""
    ocfg = ctx.objective_cfg
    new, level = rescored(ctx, batch)
    log_ratio = new.log_prob - batch.old_log_prob
    if ratio_norm:
        log_ratio = normalized_log_ratio(log_ratio, new.mean, batch.old_mean, new.std)
    ratio = torch.exp(log_ratio)
    adv = torch.clamp(batch.advantages, -ocfg.adv_clip_max, ocfg.adv_clip_max)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - ocfg.clip_range, 1.0 + ocfg.clip_range)
    w = batch.weights
    policy_loss = masked_mean(torch.maximum(unclipped, clipped), w)
    if ratio_norm:  # GRPO-Guard's step reweighting: 1 / |dt| = 1 / (sqrt(-dt))^2
        policy_loss = policy_loss / (batch.sigma - batch.sigma_next).abs()
    stats = {
        "policy_loss": policy_loss.detach(),
        "approx_kl": masked_mean(0.5 * log_ratio.detach() ** 2, w),
        # |log pi_new - log pi_sampled|; before the iteration's first step, the replay gap
        # between the sampling forward and the training forward (Updater: replay/...)
        "log_ratio_abs": masked_mean(log_ratio.detach().abs(), w),
        "clipfrac": masked_mean(((ratio.detach() - 1.0).abs() > ocfg.clip_range).float(), w),
        "ratio": masked_mean(ratio.detach(), w),
    }
    loss = policy_loss
    if ocfg.kl_coef > 0 and ctx.reference_velocity is not None:
        loss = add_penalty(loss, stats, "kl", reference_kl(ctx, batch, new, level), ocfg.kl_coef)
    stats["loss"] = loss.detach()
    return loss, stats


FLOW_GRPO = Objective("flow_grpo", flow_grpo_loss, trains_on="transitions")
register_objective(FLOW_GRPO)


def rlcm_loss(ctx: LossContext, batch: StepBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLCM (Oertell et al. 2024, "RL for Consistency Models", Sec. 4, Alg. 1): PPO's
    clipped ratio on the transitions of multistep consistency sampling, with no KL term
    (Owen-Oertell/rlcm ``core/ppo_training_loop.py``: ``-advantages * ratio`` against the
    clipped ratio, advantages clamped to +-adv_clip_max, ``torch.maximum``, the mean). The
    loss is flow-GRPO's without its KL; what makes it RLCM is the MDP (``sampling.sde_type:
    consistency``, checked at load) and DDPO's per-prompt advantages
    (``advantage.estimator: prompt_history``), which ``configs/toy_rlcm.yaml`` and the
    few-step configs set."""
    return flow_grpo_loss(ctx, batch)  # objective.kl_coef is 0 (checked at load)


register_objective(Objective("rlcm", rlcm_loss, trains_on="transitions"))
