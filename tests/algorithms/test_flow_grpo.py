"""The clipped objective and KL on small tensors, against hand computation."""

import types

import pytest
import torch

from diffrl.algorithms.flow_grpo import flow_grpo_loss
from diffrl.algorithms.objective import LossContext, StepBatch
from diffrl.models.base import Conditioning
from diffrl.sampling.sde import step


def _ocfg(**kw):
    base = dict(clip_range=0.2, adv_clip_max=5.0, kl_coef=0.0, kl_type="exact", logprob_reduction="mean")
    base.update(kw)
    return types.SimpleNamespace(**base)


def _batch(x, x_next, old_lp, adv, weights=None):
    return StepBatch(
        x_t=x,
        x_next=x_next,
        sigma=torch.tensor(0.7),
        sigma_next=torch.tensor(0.5),
        sigma_1=0.9,
        kind="sde",
        old_log_prob=old_lp,
        advantages=adv,
        cond=Conditioning({"e": torch.zeros(len(x), 1)}),
        weights=weights,
    )


def test_loss_matches_hand_computed_ppo():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    v_old, v_new = torch.randn(3, 4), torch.randn(3, 4)
    taken = step("sde", x, v_old, 0.7, 0.5, 0.7, sigma_1=0.9, noise=torch.randn(3, 4))
    adv = torch.tensor([1.5, -0.7, 8.0])  # 8.0 gets clipped to 5.0
    ctx = LossContext(lambda *_: v_new, None, _ocfg(), 0.7)
    loss, stats = flow_grpo_loss(ctx, _batch(x, taken.next_latents, taken.log_prob, adv))

    new_lp = step("sde", x, v_new, 0.7, 0.5, 0.7, sigma_1=0.9, next_latents=taken.next_latents).log_prob
    ratio = torch.exp(new_lp - taken.log_prob)
    a = adv.clamp(-5, 5)
    expected = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(stats["clipfrac"], ((ratio - 1).abs() > 0.2).float().mean())
    torch.testing.assert_close(stats["approx_kl"], (0.5 * (new_lp - taken.log_prob) ** 2).mean())


def test_on_policy_ratio_is_one_and_kl_is_zero():
    torch.manual_seed(1)
    x, v = torch.randn(4, 6), torch.randn(4, 6)
    taken = step("sde", x, v, 0.7, 0.5, 0.7, sigma_1=0.9, noise=torch.randn(4, 6))
    ctx = LossContext(lambda *_: v, lambda *_: v, _ocfg(kl_coef=0.5), 0.7)
    loss, stats = flow_grpo_loss(ctx, _batch(x, taken.next_latents, taken.log_prob, torch.ones(4)))
    assert stats["ratio"].item() == pytest.approx(1.0, abs=1e-6)
    assert stats["kl"].item() == 0.0
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)  # -A * 1


def test_kl_term_adds_exact_gaussian_kl():
    torch.manual_seed(2)
    x, v, v_ref = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    taken = step("sde", x, v, 0.7, 0.5, 0.7, sigma_1=0.9, noise=torch.randn(2, 5))
    ctx = LossContext(lambda *_: v, lambda *_: v_ref, _ocfg(kl_coef=0.1), 0.7)
    loss, stats = flow_grpo_loss(ctx, _batch(x, taken.next_latents, taken.log_prob, torch.zeros(2)))
    mean_p = step("sde", x, v, 0.7, 0.5, 0.7, sigma_1=0.9).mean
    mean_q = step("sde", x, v_ref, 0.7, 0.5, 0.7, sigma_1=0.9).mean
    expected_kl = (((mean_p - mean_q) ** 2) / (2 * taken.std.view(-1, 1) ** 2)).mean(1).mean()
    torch.testing.assert_close(stats["kl"], expected_kl)
    torch.testing.assert_close(loss, 0.1 * expected_kl)


def test_masked_samples_do_not_contribute():
    torch.manual_seed(3)
    x, v = torch.randn(3, 4), torch.randn(3, 4)
    taken = step("sde", x, v, 0.7, 0.5, 0.7, sigma_1=0.9, noise=torch.randn(3, 4))
    v_new = v + 0.3 * torch.randn(3, 4)
    ctx = LossContext(lambda xx, *_: v_new[: len(xx)], None, _ocfg(), 0.7)
    adv = torch.tensor([1.0, -2.0, 100.0])
    masked, _ = flow_grpo_loss(
        ctx, _batch(x, taken.next_latents, taken.log_prob, adv, torch.tensor([1.0, 1.0, 0.0]))
    )
    only_two, _ = flow_grpo_loss(ctx, _batch(x[:2], taken.next_latents[:2], taken.log_prob[:2], adv[:2]))
    torch.testing.assert_close(masked, only_two)
