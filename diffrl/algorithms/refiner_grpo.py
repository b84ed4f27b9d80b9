"""The refiner's GRPO loss (PromptRL; G-U-N/UniRL@53c28c9
``unirl/trainer/geneval_grpo_trainer.py:405-428``).

Per completion token t of rewrite i, with advantage A_i (the flow model's group
advantage of the image rendered from that rewrite), ratio r = exp(log pi(t) - log
pi_old(t)) and the k3 estimate of KL(pi || pi_ref) (Schulman 2020),

    k3 = exp(log pi_ref(t) - log pi(t)) - (log pi_ref(t) - log pi(t)) - 1,
    l_t = -min(A_i r, A_i clip(r, 1 - eps, 1 + eps)) + beta k3,

and the loss is the mean over rewrites of each rewrite's token mean (UniRL: per-sequence
token mean up to the first end token, then the batch mean; ``beta`` 0.01). UniRL takes
one on-policy step per iteration, r = exp(log pi - log pi.detach()) = 1, so its clip never
binds; with the sampling policy's log-probs as ``old`` the first step here is that step.
"""

from __future__ import annotations

import torch


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token (>= 0, unbiased)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def refiner_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    completion: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, statistics) over the rewrites with at least one completion token (B, L tensors;
    ``advantages`` (B,)). See the module docstring."""
    rows = completion.any(1)
    mask = completion[rows].float()
    logp, old_logp, ref_logp = logp[rows], old_logp[rows], ref_logp[rows]
    adv = advantages[rows].to(logp)[:, None]
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(adv * ratio, adv * ratio.clamp(1 - clip_range, 1 + clip_range))
    kl = k3_kl(logp, ref_logp)
    per_token = -surrogate + kl_coef * kl
    tokens = mask.sum(1)
    per_rewrite = (per_token * mask).sum(1) / tokens
    loss = per_rewrite.mean()
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_range).float()
        stats = {
            "refiner/loss": float(loss),
            "refiner/kl": float(((kl * mask).sum(1) / tokens).mean()),
            "refiner/clipped_fraction": float((clipped * mask).sum() / mask.sum()),
            "refiner/tokens_per_rewrite": float(tokens.mean()),
        }
    return loss, stats
