"""The refiner's GRPO loss (PromptRL / UniRL): k3 against torch.distributions, the loss
against a per-token loop, and UniRL's on-policy gradient at ratio 1."""

from __future__ import annotations

import pytest
import torch

from diffrl.algorithms.refiner_grpo import k3_kl, refiner_loss


def test_k3_is_an_unbiased_estimate_of_the_kl_to_the_reference():
    """E_{x ~ pi}[k3(x)] = KL(pi || pi_ref), exactly, over a categorical."""
    gen = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(5, 11, generator=gen), torch.randn(5, 11, generator=gen)
    pi, ref = (
        torch.distributions.Categorical(logits=logits),
        torch.distributions.Categorical(logits=ref_logits),
    )
    expected = (pi.probs * k3_kl(pi.logits, ref.logits)).sum(-1)
    torch.testing.assert_close(expected, torch.distributions.kl_divergence(pi, ref), rtol=1e-5, atol=1e-6)
    assert bool((k3_kl(pi.logits, ref.logits) >= 0).all())


def _loop_loss(logp, old, ref, mask, adv, clip, beta):
    """The loss token by token, rewrite by rewrite (the module docstring's formula)."""
    per_rewrite = []
    for i in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            surrogate = min(adv[i] * r, adv[i] * r.clamp(1 - clip, 1 + clip))
            d = ref[i, t] - logp[i, t]
            terms.append(-surrogate + beta * (torch.exp(d) - d - 1))
        if terms:
            per_rewrite.append(torch.stack(terms).mean())
    return torch.stack(per_rewrite).mean()


def test_the_loss_is_the_per_rewrite_token_mean_then_the_mean_over_rewrites():
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 7, generator=gen) * 3
    old = logp + 0.3 * torch.randn(4, 7, generator=gen)  # some ratios outside the clip
    ref = logp + 0.5 * torch.randn(4, 7, generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0] * 7, [0, 0, 0, 0, 0, 1, 1]]).bool()
    adv = torch.tensor([1.5, -0.7, 3.0, 0.2])
    loss, stats = refiner_loss(logp, old, ref, mask, adv, 0.2, 0.05)
    assert float(loss) == pytest.approx(float(_loop_loss(logp, old, ref, mask, adv, 0.2, 0.05)), rel=1e-6)
    assert stats["refiner/tokens_per_rewrite"] == pytest.approx((3 + 6 + 2) / 3)  # the empty row is left out
    assert 0 < stats["refiner/clipped_fraction"] < 1


def test_on_policy_the_gradient_is_unirls_advantage_weighted_token_mean():
    """At old = logp (one update per iteration, UniRL's exp(logp - logp.detach())), the
    gradient of each token's log-prob is -A / (tokens in its rewrite) / rewrites without KL."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -4.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    adv = torch.tensor([2.0, -1.0])
    loss, _ = refiner_loss(logp, logp.detach(), logp.detach(), mask, adv, 0.2, 0.0)
    loss.backward()
    expected = torch.tensor([[-2.0 / 2, -2.0 / 2, 0.0], [1.0 / 3, 1.0 / 3, 1.0 / 3]]) / 2
    torch.testing.assert_close(logp.grad, expected)
