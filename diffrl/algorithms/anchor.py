"""A velocity anchor for the denoising steps an objective does not train.

Flow-GRPO with an SDE window (Flow-GRPO-Fast / MixGRPO, Li et al. 2025) computes a
policy ratio only at the window's stochastic steps. The LoRA weights are shared by every
step, so those updates also move the velocity at the deterministic steps, which no loss
credits or restrains. On ShapeWorld that drift paints a texture into the background at the
low-noise steps (docs/notes/2026-11-shapeworld-history.md). The anchor restrains exactly those steps:

    L_anchor = anchor_coef * mean_i ||v_theta(x_t^i, t) - v_ref(x_t^i, t)||^2

on the rollout's own states x_t^i at untrained steps t, with v_ref the reference policy
(LoRA disabled, or the frozen copy). BranchGRPO trees (Li et al. 2025) train only their
stochastic edges, so their ODE steps are anchored the same way, on the nodes there
(:func:`diffrl.training.passes.add_tree_anchors`). It is the velocity-space KL that
DiffusionNFT (Zheng et al. 2025, Sec. 3) adds to its loss, applied where the
policy-gradient loss is absent;
for two Gaussians of equal std it is proportional to their KL (Flow-GRPO, Eq. 11).

No reference implementation: this term is ours (issue 15).
"""

from __future__ import annotations

import torch

from diffrl.algorithms.objective import LossContext, StepBatch, masked_mean


def anchor_loss(ctx: LossContext, batch: StepBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """anchor_coef x per-sample mean squared velocity difference to the reference."""
    if ctx.reference_velocity is None:
        raise ValueError("objective.anchor_coef > 0 needs a reference policy")
    b = batch.x_t.shape[0]
    sigma_b = batch.sigma.expand(b)
    with torch.no_grad():  # first: the reference may disable the adapters of the live model
        v_ref = ctx.reference_velocity(batch.x_t, sigma_b, batch.cond).detach()
    v = ctx.policy_velocity(batch.x_t, sigma_b, batch.cond)
    drift = masked_mean((v - v_ref).pow(2).flatten(1).mean(1), batch.weights)
    return ctx.objective_cfg.anchor_coef * drift, {"anchor/drift": drift.detach()}
