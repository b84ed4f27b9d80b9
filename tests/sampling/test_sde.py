"""The SDE step against independent references (torch.distributions, the Euler step,
closed-form Gaussian KL)."""

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from diffrl.sampling.sde import gaussian_kl, gaussian_log_prob, step, step_mean_std


def _inputs(b=3, shape=(4, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_log_prob_matches_torch_normal(reduction):
    x, mean = _inputs()
    std = torch.tensor([0.3, 1.2, 0.05])
    ref = Normal(mean, std.view(-1, 1, 1)).log_prob(x)
    ref = ref.mean(dim=(1, 2)) if reduction == "mean" else ref.sum(dim=(1, 2))
    torch.testing.assert_close(gaussian_log_prob(x, mean, std, reduction), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["sde", "cps", "dance", "consistency"])
def test_step_log_prob_is_normal_density_of_sample(kind):
    x, v = _inputs()
    eps = torch.randn_like(x)
    res = step(kind, x, v, 0.7, 0.5, 0.8, sigma_1=0.9, noise=eps)
    ref = Normal(res.mean, res.std.view(-1, 1, 1)).log_prob(res.next_latents).mean(dim=(1, 2))
    torch.testing.assert_close(res.log_prob, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.next_latents, res.mean + res.std.view(-1, 1, 1) * eps)


def test_flow_grpo_sde_formula_by_hand():
    """Flow-GRPO: std_t = a sqrt(s/(1-s)); mean = x + [v + std_t^2/(2s)(x + (1-s)v)] dt."""
    x, v = _inputs(b=1, shape=(3,))
    s, s_next, a = 0.6, 0.4, 0.7
    dt = s_next - s
    std_t = a * math.sqrt(s / (1 - s))
    mean_ref = x + (v + std_t**2 / (2 * s) * (x + (1 - s) * v)) * dt
    mean, std, got_std_t = step_mean_std("sde", x, v, s, s_next, a)
    torch.testing.assert_close(mean, mean_ref)
    assert got_std_t.item() == pytest.approx(std_t)
    assert std.item() == pytest.approx(std_t * math.sqrt(-dt))


def test_flow_grpo_sde_at_sigma_one_uses_sigma_1():
    x, v = _inputs(b=1, shape=(3,))
    _, _, std_t = step_mean_std("sde", x, v, 1.0, 0.9, 0.7, sigma_1=0.9)
    assert std_t.item() == pytest.approx(0.7 * math.sqrt(1.0 / (1 - 0.9)))
    assert torch.isfinite(std_t).all()


def test_cps_formula_by_hand():
    x, v = _inputs(b=1, shape=(3,))
    s, s_next, a = 0.6, 0.4, 0.5
    std = s_next * math.sin(a * math.pi / 2)
    x0, x1 = x - s * v, x + (1 - s) * v
    mean_ref = x0 * (1 - s_next) + x1 * math.sqrt(s_next**2 - std**2)
    mean, got_std, _ = step_mean_std("cps", x, v, s, s_next, a)
    torch.testing.assert_close(mean, mean_ref)
    assert got_std.item() == pytest.approx(std)


def test_dance_formula_by_hand():
    x, v = _inputs(b=1, shape=(3,))
    s, s_next, eta = 0.6, 0.4, 0.3
    dt = s_next - s
    x0 = x - s * v
    score = -(x - (1 - s) * x0) / s**2
    mean_ref = x + dt * v - 0.5 * eta**2 * score * dt
    mean, std, _ = step_mean_std("dance", x, v, s, s_next, eta)
    torch.testing.assert_close(mean, mean_ref)
    assert std.item() == pytest.approx(eta * math.sqrt(-dt))


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_noise_level_zero_equals_ode(kind):
    x, v = _inputs()
    res = step(kind, x, v, 0.8, 0.55, 0.0, sigma_1=0.9, noise=torch.randn_like(x))
    torch.testing.assert_close(res.next_latents, x + v * (0.55 - 0.8))


def test_ode_is_euler_and_has_zero_log_prob():
    x, v = _inputs()
    res = step("ode", x, v, 0.5, 0.25, 0.7, noise=torch.randn_like(x))
    torch.testing.assert_close(res.next_latents, x - 0.25 * v)
    assert (res.log_prob == 0).all() and (res.std == 0).all()


def test_scoring_given_next_latents_reproduces_sampled_log_prob():
    x, v = _inputs()
    taken = step("sde", x, v, 0.7, 0.5, 0.7, sigma_1=0.9, noise=torch.randn_like(x))
    scored = step("sde", x, v, 0.7, 0.5, 0.7, sigma_1=0.9, next_latents=taken.next_latents)
    torch.testing.assert_close(scored.log_prob, taken.log_prob, rtol=0, atol=0)


def test_exact_kl_matches_torch_kl_divergence():
    mp, mq = _inputs()
    std = torch.tensor([0.2, 0.5, 1.0])
    ref = kl_divergence(Normal(mp, std.view(-1, 1, 1)), Normal(mq, std.view(-1, 1, 1))).mean(dim=(1, 2))
    torch.testing.assert_close(gaussian_kl(mp, mq, std, std * 7, "exact"), ref, rtol=1e-5, atol=1e-6)


def test_flow_grpo_kl_variant_divides_by_std_t():
    mp, mq = _inputs()
    std_t = torch.tensor([0.4, 0.4, 0.4])
    expected = ((mp - mq) ** 2).mean(dim=(1, 2)) / (2 * 0.4**2)
    torch.testing.assert_close(gaussian_kl(mp, mq, std_t * 0.1, std_t, "flow_grpo"), expected)


def test_unknown_kind_is_rejected_by_name():
    x, v = _inputs()
    with pytest.raises(ValueError, match="valid: sde, cps, dance, consistency, ode"):
        step("sdee", x, v, 0.5, 0.4, 0.7)


def test_sde_first_step_below_pure_noise_uses_sigma_1_like_flow_grpo_does_at_sigma_1():
    """DPM-Solver / UniPC grids start at 0.9997 / 1 - 1e-6: 1 - sigma there would make std_t
    55x / 1000x the noise level. The first step of any grid uses 1 - sigma_1, as flow_grpo
    does where sigma = 1, and later steps are unchanged."""
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    for s0 in (1.0, 0.99966645, 0.999999):
        _, std, std_t = step_mean_std("sde", x, v, s0, 0.96, 0.7, sigma_1=0.96)
        assert torch.allclose(std_t, torch.full((2,), 0.7 * math.sqrt(s0 / (1 - 0.96))))
    _, _, later = step_mean_std("sde", x, v, 0.9, 0.8, 0.7, sigma_1=0.96)
    assert torch.allclose(later, torch.full((2,), 0.7 * math.sqrt(0.9 / 0.1)))


def test_consistency_step_predicts_the_clean_sample_and_renoises_it_with_fresh_noise():
    """Multistep consistency sampling (Song et al. 2023, Alg. 1; RLCM's MDP) in flow
    matching, written out: x0_hat = x - sigma v, x' = (1 - sigma') x0_hat + sigma' eps, so
    x' ~ N((1 - sigma') x0_hat, sigma'^2), whatever the noise level; equal to cps at a = 1."""
    x, v = _inputs()
    eps = torch.randn_like(x)
    sigma, sigma_next = 0.8, 0.35
    res = step("consistency", x, v, sigma, sigma_next, 0.123, noise=eps)
    x0_hat = x - sigma * v
    torch.testing.assert_close(res.next_latents, (1 - sigma_next) * x0_hat + sigma_next * eps)
    torch.testing.assert_close(res.std, torch.full((3,), sigma_next))
    ref = Normal((1 - sigma_next) * x0_hat, sigma_next).log_prob(res.next_latents)
    torch.testing.assert_close(res.log_prob, ref.mean(dim=(1, 2)), rtol=1e-5, atol=1e-5)
    summed = step("consistency", x, v, sigma, sigma_next, 0.7, next_latents=res.next_latents, reduction="sum")
    torch.testing.assert_close(summed.log_prob, ref.sum(dim=(1, 2)), rtol=1e-5, atol=1e-4)
    cps = step("cps", x, v, sigma, sigma_next, 1.0, noise=eps)
    torch.testing.assert_close(cps.mean, res.mean)
    torch.testing.assert_close(cps.std, res.std)


def test_the_last_consistency_step_returns_the_predicted_clean_sample_untrained():
    x, v = _inputs()
    res = step("consistency", x, v, 0.25, 0.0, 0.7, noise=torch.randn_like(x))
    torch.testing.assert_close(res.next_latents, x - 0.25 * v)
    assert torch.all(res.std == 0) and torch.all(res.log_prob == 0)
