"""GRPO-Guard, Flow-DPPO, AWM and DGPO on small tensors: each loss against a hand
computation or an independent formula (torch.distributions for densities, autograd of
the paper's own loss for DGPO's surrogate), and ratio = 1 / KL = 0 / no mask where the
policy has not moved."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from diffrl.algorithms import get_objective
from diffrl.algorithms.awm import huber_log_likelihood
from diffrl.algorithms.dgpo import group_logits
from diffrl.algorithms.flow_dppo import divergence_mask
from diffrl.algorithms.grpo_guard import normalized_log_ratio
from diffrl.algorithms.objective import LossContext, StepBatch
from diffrl.models.base import Conditioning
from diffrl.sampling.sde import step

SIGMA, SIGMA_NEXT, LEVEL = 0.7, 0.5, 0.7


def _ocfg(**kw):
    """The objective section the losses read; ``objective.args`` keys go to its ``args``."""
    base = dict(clip_range=0.2, adv_clip_max=5.0, kl_coef=0.0, kl_type="exact", logprob_reduction="mean")
    args = dict(kl_threshold=1e-3, huber_power=0.25, advantage_max=1.0, ema_beta=0.0, beta=10.0)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    return SimpleNamespace(**{**base, **kw}, args=SimpleNamespace(**args))


def _transition(seed=0, rows=3, dims=8):
    """A rollout transition under v_old and a moved policy velocity v_new."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dims, generator=g)
    v_old = torch.randn(rows, dims, generator=g)
    v_new = v_old + 0.3 * torch.randn(rows, dims, generator=g)
    eps = torch.randn(rows, dims, generator=g)
    taken = step("sde", x, v_old, SIGMA, SIGMA_NEXT, LEVEL, sigma_1=0.9, noise=eps)
    return x, v_old, v_new, eps, taken


def _transition_batch(x, taken, adv):
    return StepBatch(
        x_t=x,
        x_next=taken.next_latents,
        sigma=torch.tensor(SIGMA),
        sigma_next=torch.tensor(SIGMA_NEXT),
        sigma_1=0.9,
        kind="sde",
        old_log_prob=taken.log_prob,
        advantages=adv,
        cond=Conditioning({"e": torch.zeros(len(x), 1)}),
        old_mean=taken.mean,
    )


# -- GRPO-Guard ----------------------------------------------------------------------------
def test_normalised_log_ratio_is_the_mean_of_eps_times_the_mean_shift():
    """log rho = s log r + mean(d^2)/(2 s) = mean(eps * d) for x' = mu_old + s eps, with
    log r from torch.distributions' Normal densities (mean over dimensions)."""
    x, v_old, v_new, eps, taken = _transition()
    new = step("sde", x, v_new, SIGMA, SIGMA_NEXT, LEVEL, sigma_1=0.9, next_latents=taken.next_latents)
    s = taken.std.reshape(-1, 1)
    density = torch.distributions.Normal

    def log_p(mean):
        return density(mean.double(), s.double()).log_prob(taken.next_latents.double()).mean(1)

    log_r = log_p(new.mean) - log_p(taken.mean)
    rho = normalized_log_ratio(log_r, new.mean, taken.mean, taken.std)
    expected = (eps.double() * (new.mean.double() - taken.mean.double())).mean(1)
    # x' and both means are stored in fp32: the identity holds to fp32 rounding of them
    torch.testing.assert_close(rho, expected, rtol=1e-4, atol=1e-7)


def test_grpo_guard_loss_is_the_clipped_normalised_ratio_over_dt_and_one_on_policy():
    x, v_old, v_new, eps, taken = _transition(seed=1)
    adv = torch.tensor([1.5, -0.7, 8.0])
    guard = get_objective("grpo_guard")
    loss, stats = guard(
        LossContext(lambda *_: v_new, None, _ocfg(clip_range=0.01), LEVEL), _transition_batch(x, taken, adv)
    )
    new = step("sde", x, v_new, SIGMA, SIGMA_NEXT, LEVEL, sigma_1=0.9, next_latents=taken.next_latents)
    rho = torch.exp((eps * (new.mean - taken.mean)).mean(1))
    a = adv.clamp(-5, 5)
    expected = torch.maximum(-a * rho, -a * rho.clamp(0.99, 1.01)).mean() / (SIGMA - SIGMA_NEXT)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    _, still = guard(LossContext(lambda *_: v_old, None, _ocfg(), LEVEL), _transition_batch(x, taken, adv))
    assert still["ratio"].item() == pytest.approx(1.0, abs=1e-6) and still["clipfrac"].item() == 0


# -- Flow-DPPO -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "divergence, ratio, adv, kept",
    [
        (1e-2, 1.1, 1.0, False),  # outside the region, moving further in A's direction
        (1e-2, 0.9, -1.0, False),
        (1e-2, 0.9, 1.0, True),  # outside, but moving back
        (1e-2, 1.1, -1.0, True),
        (1e-4, 1.1, 1.0, True),  # inside the region
        (1e-3, 1.1, 1.0, False),  # the boundary counts as outside (D >= tau)
    ],
)
def test_divergence_mask_follows_eq_18(divergence, ratio, adv, kept):
    mask = divergence_mask(torch.tensor([divergence]), torch.tensor([ratio]), torch.tensor([adv]), 1e-3)
    assert bool(mask) is kept


def test_flow_dppo_loss_masks_by_the_gaussian_kl_and_keeps_everything_on_policy():
    x, v_old, v_new, eps, taken = _transition(seed=2, rows=6)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    dppo = get_objective("flow_dppo")
    loss, stats = dppo(LossContext(lambda *_: v_new, None, _ocfg(), LEVEL), _transition_batch(x, taken, adv))
    new = step("sde", x, v_new, SIGMA, SIGMA_NEXT, LEVEL, sigma_1=0.9, next_latents=taken.next_latents)
    ratio = torch.exp(new.log_prob - taken.log_prob)
    kl = torch.distributions.kl_divergence(  # per dimension, averaged: the reference's mean reduction
        torch.distributions.Normal(new.mean, taken.std.reshape(-1, 1)),
        torch.distributions.Normal(taken.mean, taken.std.reshape(-1, 1)),
    ).mean(1)
    drop = (kl >= 1e-3) & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
    assert 0 < int(drop.sum()) < 6  # the case mixes masked and kept transitions
    torch.testing.assert_close(loss, (-adv * ratio * (~drop).float()).mean())
    torch.testing.assert_close(stats["dppo/masked"], drop.float().mean())
    _, still = dppo(LossContext(lambda *_: v_old, None, _ocfg(), LEVEL), _transition_batch(x, taken, adv))
    assert still["dppo/masked"].item() == 0 and still["dppo/divergence"].item() == 0


# -- AWM and DGPO: clean samples noised afresh ---------------------------------------------
def _clean_batch(adv, groups=None, seed=3, rows=4, dims=6, sigma=0.6):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(rows, dims, generator=g), torch.randn(rows, dims, generator=g)
    s = torch.tensor(sigma)
    return StepBatch(
        x_t=(1 - s) * x0 + s * eps,
        x_next=x0,
        sigma=s,
        sigma_next=s,
        sigma_1=None,
        kind="ode",
        old_log_prob=torch.zeros(rows),
        advantages=torch.tensor(adv),
        cond=None,
        x0=x0,
        forward_noise=eps,
        groups=groups,
    )


def _linear_policy(scale=0.8, shift=0.1):
    w = torch.tensor(scale, requires_grad=True)
    return w, (lambda x, s, c: w * x + shift)


def test_huber_log_likelihood_matches_the_formula_and_is_minus_t_l_at_power_one():
    err, t = torch.tensor([0.0, 1e-6, 0.3, 2.0]), torch.tensor(0.6)
    expected = -(0.6 / 0.25) * ((err.double() + 1e-10) ** 0.25 - 1e-10**0.25)
    torch.testing.assert_close(huber_log_likelihood(err, t, 0.25).double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(huber_log_likelihood(err, t, 1.0), -0.6 * err, rtol=1e-6, atol=1e-12)


def test_awm_gradient_is_minus_scaled_advantage_times_the_surrogate_gradient():
    adv = [2.0, -1.0, 7.0, -0.5]  # 7 is clipped to 5, then every advantage scaled by 1/5
    batch = _clean_batch(adv)
    w, policy = _linear_policy()
    loss, stats = get_objective("awm")(LossContext(policy, None, _ocfg(), LEVEL), batch)
    a = torch.tensor(adv).clamp(-5, 5) / 5
    assert loss.item() == pytest.approx(float(-a.mean()), rel=1e-6)  # ratio exp(0) = 1
    loss.backward()
    # the same gradient by hand: d/dw of mean_i(-a_i log p_i), log p = -(t/p)(l^p), l = mean((w x + b - u)^2)
    x, u = batch.x_t.double(), (batch.forward_noise - batch.x0).double()
    wd = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    err = ((wd * x + 0.1 - u) ** 2).mean(1)
    log_p = -(0.6 / 0.25) * ((err + 1e-10) ** 0.25 - 1e-10**0.25)
    (-(a.double() * log_p).mean()).backward()
    assert w.grad.item() == pytest.approx(wd.grad.item(), rel=1e-5)


def test_awm_ema_and_reference_penalties_are_zero_when_nothing_moved():
    batch = _clean_batch([1.0, -1.0, 0.5, -0.5])
    _, policy = _linear_policy()
    ctx = LossContext(policy, policy, _ocfg(ema_beta=1.0, kl_coef=0.1), LEVEL, old_velocity=policy)
    _, stats = get_objective("awm")(ctx, batch)
    assert stats["awm/ema_kl"].item() == 0 and stats["kl"].item() == 0


def test_group_logits_sum_each_group_by_hand():
    adv, delta = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5]), torch.tensor([0.1, 0.3, -0.2, 0.4, 1.0])
    groups = torch.tensor([7, 7, 3, 3, 3])
    out = group_logits(adv, delta, groups, beta=10.0)
    g7 = 10.0 * (1.0 * 0.1 - 1.0 * 0.3) / 2
    g3 = 10.0 * (2.0 * -0.2 - 2.0 * 0.4 + 0.5 * 1.0) / 3
    torch.testing.assert_close(out, torch.tensor([g7, g7, g3, g3, g3]))


def test_dgpo_surrogate_has_the_gradient_of_the_group_preference_loss():
    """d surrogate / d l_i = (G / (beta B)) d(sum_g L_g) / d l_i, L_g = softplus((beta/G)
    sum A (l - l_ref)): autograd of the paper's loss is the reference."""
    adv = [1.0, -1.0, 0.5, -0.5]
    groups = torch.tensor([0, 0, 1, 1])
    batch = _clean_batch(adv, groups)
    w, policy = _linear_policy()
    ref = lambda x, s, c: 0.6 * x  # noqa: E731
    beta = 10.0
    loss, stats = get_objective("dgpo")(LossContext(policy, ref, _ocfg(beta=beta), LEVEL), batch)
    loss.backward()
    wd = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    x, u = batch.x_t.double(), (batch.forward_noise - batch.x0).double()
    err, err_ref = ((wd * x + 0.1 - u) ** 2).mean(1), ((0.6 * x - u) ** 2).mean(1)
    a = torch.tensor(adv, dtype=torch.float64)
    paper = sum(
        F.softplus(beta / 2 * (a[i] * (err[i] - err_ref[i]) + a[j] * (err[j] - err_ref[j])))
        for i, j in ((0, 1), (2, 3))
    )
    paper.backward()
    assert w.grad.item() == pytest.approx(wd.grad.item() * 2 / (beta * 4), rel=1e-5)
    assert stats["dgpo/preference_loss"].item() == pytest.approx(float(paper.detach()) / 2, rel=1e-5)


def test_dgpo_weighs_every_group_one_half_when_policy_is_the_reference():
    batch = _clean_batch([1.0, -1.0, 0.5, -0.5], torch.tensor([0, 0, 1, 1]))
    _, policy = _linear_policy()
    _, stats = get_objective("dgpo")(LossContext(policy, policy, _ocfg(kl_coef=0.1), LEVEL), batch)
    assert stats["dgpo/group_weight"].item() == 0.5 and stats["kl"].item() == 0
    assert stats["dgpo/preference_loss"].item() == pytest.approx(float(F.softplus(torch.tensor(0.0))))
