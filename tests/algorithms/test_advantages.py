"""Advantage estimators against values computed by hand."""

import pytest
import torch

from diffrl.algorithms.advantages import compute_advantages

EPS = 0.0  # exact arithmetic in the hand computations


def test_group_mean_std_by_hand():
    r = torch.tensor([1.0, 3.0, 10.0, 20.0])
    g = torch.tensor([0, 0, 1, 1])
    # group 0: mean 2, pop std 1 -> [-1, 1]; group 1: mean 15, std 5 -> [-1, 1]
    out = compute_advantages(r, g, "group", eps=EPS)
    torch.testing.assert_close(out.values, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    assert out.keep.all() and out.filtered_fraction == 0.0


def test_global_std_by_hand():
    r = torch.tensor([1.0, 3.0, 5.0, 7.0])
    g = torch.tensor([0, 0, 1, 1])
    std = torch.tensor([1.0, 3.0, 5.0, 7.0]).std(unbiased=False)  # sqrt(5)
    out = compute_advantages(r, g, "global_std", eps=EPS)
    torch.testing.assert_close(out.values, torch.tensor([-1.0, 1.0, -1.0, 1.0]) / std)


def test_median_centred_with_pivot_excluded():
    r = torch.tensor([0.0, 1.0, 5.0])  # odd group: median 1 is the pivot
    out = compute_advantages(r, torch.zeros(3, dtype=torch.long), "median", eps=EPS)
    std = r.std(unbiased=False)
    torch.testing.assert_close(out.values, torch.tensor([-1.0, 0.0, 4.0]) / std)
    assert out.keep.tolist() == [True, False, True]


def test_median_even_group_uses_middle_mean_and_keeps_all():
    r = torch.tensor([0.0, 1.0, 3.0, 10.0])  # median (1 + 3) / 2 = 2
    out = compute_advantages(r, torch.zeros(4, dtype=torch.long), "median", eps=EPS)
    torch.testing.assert_close(out.values, (r - 2.0) / r.std(unbiased=False))
    assert out.keep.all()


def test_decoupled_gdpo_by_hand():
    # two rewards, one group of 2 and one of 2
    comps = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    w = torch.tensor([1.0, 0.5])
    g = torch.tensor([0, 0, 1, 1])
    # per-reward group norm: reward0 -> [-1,1, 0,0] (group 1 has zero var -> 0), reward1 -> [0,0,-1,1]
    summed = torch.tensor([-1.0, 1.0, -0.5, 0.5])
    expected = (summed - summed.mean()) / summed.std(unbiased=False)
    total = (comps * w).sum(1)
    out = compute_advantages(total, g, "decoupled", eps=EPS, components=comps, weights=w)
    torch.testing.assert_close(out.values, expected)


def test_zero_variance_groups_filtered_and_counted():
    r = torch.tensor([2.0, 2.0, 1.0, 3.0])
    g = torch.tensor([0, 0, 1, 1])
    out = compute_advantages(r, g, "group", eps=1e-4, filter_zero_std=True)
    assert out.keep.tolist() == [False, False, True, True]
    assert out.filtered_fraction == pytest.approx(0.5)
    assert out.values[:2].abs().sum() == 0
    kept = compute_advantages(r, g, "group", eps=1e-4, filter_zero_std=False)
    assert kept.keep.all() and kept.filtered_fraction == pytest.approx(0.5)


def test_unknown_estimator_lists_valid():
    with pytest.raises(ValueError, match="group, global_std, median, decoupled"):
        compute_advantages(torch.ones(2), torch.zeros(2), "mean")


@pytest.mark.parametrize("estimator", ["group", "global_std", "median", "decoupled"])
def test_a_group_with_a_nonfinite_reward_is_dropped_and_the_rest_is_as_if_it_was_never_sampled(estimator):
    torch.manual_seed(0)
    rewards = torch.rand(12)
    comps = torch.stack([rewards, torch.rand(12)], 1)
    groups = torch.arange(12) // 4  # three groups of four
    weights = torch.tensor([1.0, 0.5])
    poisoned, poisoned_comps = rewards.clone(), comps.clone()
    poisoned[5] = float("nan")  # group 1
    poisoned_comps[9, 1] = float("inf")  # group 2, through a component only
    out = compute_advantages(poisoned, groups, estimator, components=poisoned_comps, weights=weights)
    clean = groups == 0
    alone = compute_advantages(
        rewards[clean], groups[clean], estimator, components=comps[clean], weights=weights
    )
    assert out.dropped_groups == 2 and out.dropped_samples == 8
    assert torch.equal(out.values[clean], alone.values) and torch.equal(out.keep[clean], alone.keep)
    assert torch.equal(out.values[~clean], torch.zeros(8)) and not bool(out.keep[~clean].any())
    assert bool(torch.isfinite(out.values).all())


def test_when_every_group_has_a_nonfinite_reward_nothing_is_kept():
    out = compute_advantages(torch.tensor([float("nan"), 1.0, float("nan"), 0.0]), torch.tensor([0, 0, 1, 1]))
    assert out.dropped_groups == 2 and not bool(out.keep.any()) and torch.equal(out.values, torch.zeros(4))


@pytest.mark.parametrize("estimator", ["group", "global_std", "median"])
def test_sample_std_convention_is_numpys_ddof_1(estimator):
    import numpy as np

    r = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.3, 0.3, 0.8, 0.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = compute_advantages(r, g, estimator, eps=1e-8, std="sample").values.double()
    x = r.double().numpy()
    for grp in (0, 1):
        sel = (g == grp).numpy()
        centre = np.median(x[sel]) if estimator == "median" else x[sel].mean()
        std = (x if estimator == "global_std" else x[sel]).std(ddof=1)
        np.testing.assert_allclose(adv[sel].numpy(), (x[sel] - centre) / (std + 1e-8), rtol=1e-6)
    pop = compute_advantages(r, g, estimator, eps=1e-8).values
    assert not torch.allclose(pop, adv.float())


def test_unknown_std_convention_is_one_clear_error():
    with pytest.raises(ValueError, match="advantage.std must be one of population, sample"):
        compute_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), std="ddof1")
