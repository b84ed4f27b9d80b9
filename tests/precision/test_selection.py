"""Sol-RL subset rules pick exactly the intended pool indices; rank agreement matches
its definitions (a brute-force pair count, the no-ties closed form, hand values)."""

import itertools
import math

import pytest
import torch

from diffrl.precision.selection import rank_agreement, select_subset
from rewards.ranking import average_ranks, kendall_tau, spearman_rho


def test_best_worst_takes_top_and_bottom_in_pool_order():
    rewards = torch.tensor([[0.5, 0.9, 0.1, 0.7, 0.3, 0.2], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    chosen = select_subset(rewards, 4, "best_worst")
    assert chosen.tolist() == [[1, 2, 3, 5], [0, 1, 4, 5]]
    # odd k: one more from the bottom, as Sol-RL's select_best_worst (k // 2 best, the rest worst)
    assert select_subset(rewards, 3, "best_worst").tolist() == [[1, 2, 5], [0, 1, 5]]


def test_best_worst_breaks_ties_by_pool_index():
    rewards = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    # best: the first two of the tied top (indices 0, 1); worst: the last two of the tied bottom
    assert select_subset(rewards, 4, "best_worst").tolist() == [[0, 1, 4, 5]]


def _brute_force_max_variance(row, k):
    best = max(
        itertools.combinations(range(len(row)), k),
        key=lambda c: torch.tensor([row[i] for i in c], dtype=torch.float64).var(unbiased=False).item(),
    )
    return torch.tensor([row[i] for i in best], dtype=torch.float64).var(unbiased=False).item()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_max_variance_equals_brute_force(seed, k):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(3, 8, generator=g) ** 3  # skewed, so the best split is rarely k/2
    chosen = select_subset(rewards, k, "max_variance")
    for row, idx in zip(rewards, chosen):
        got = row.double()[idx].var(unbiased=False).item()
        assert got == pytest.approx(_brute_force_max_variance(row.tolist(), k), rel=1e-12)
        assert len(set(idx.tolist())) == k


def test_max_variance_prefers_the_longer_tail():
    # one outlier above, the rest bunched low: the best 3-subset is the outlier + the two lowest
    rewards = torch.tensor([[10.0, 0.0, 0.1, 0.2, 0.3, 0.4]])
    assert select_subset(rewards, 3, "max_variance").tolist() == [[0, 1, 2]]
    assert select_subset(rewards, 3, "best_worst").tolist() == [[0, 1, 2]]  # here best_worst finds it too
    # one outlier below: two from the top beat best_worst's one-best-two-worst
    low = torch.tensor([[0.0, 10.0, 9.9, 9.8, 9.7, 9.6]])
    assert select_subset(low, 3, "max_variance").tolist() == [[0, 1, 2]]
    assert select_subset(low, 3, "best_worst").tolist() == [[0, 1, 5]]


def test_random_is_keyed_and_distinct():
    rewards = torch.zeros(4, 10)
    a = select_subset(rewards, 4, "random", (0, 7, 3))
    assert torch.equal(a, select_subset(rewards, 4, "random", (0, 7, 3)))
    assert not torch.equal(a, select_subset(rewards, 4, "random", (0, 8, 3)))
    assert all(len(set(r.tolist())) == 4 and r.tolist() == sorted(r.tolist()) for r in a)
    assert not all(torch.equal(a[0], r) for r in a[1:])  # rows draw separately


def test_random_ignores_rewards():
    g = torch.Generator().manual_seed(0)
    assert torch.equal(
        select_subset(torch.randn(2, 8, generator=g), 3, "random", (1,)),
        select_subset(torch.zeros(2, 8), 3, "random", (1,)),
    )


def test_bad_selection_inputs():
    with pytest.raises(ValueError, match="unknown solrl.select 'best'"):
        select_subset(torch.zeros(1, 4), 2, "best")
    with pytest.raises(ValueError, match="cannot select 5 of 4"):
        select_subset(torch.zeros(1, 4), 5, "best_worst")


def _tau_b_pairs(a, b):
    """Kendall tau-b by explicit pair counting (the textbook definition)."""
    conc = disc = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            ties_a += 1
        elif db == 0:
            ties_b += 1
        elif da * db > 0:
            conc += 1
        else:
            disc += 1
    return (conc - disc) / math.sqrt((conc + disc + ties_a) * (conc + disc + ties_b))


@pytest.mark.parametrize("seed", range(6))
def test_kendall_tau_matches_pair_counting_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 4, (9,), generator=g).double()
    b = torch.randint(0, 4, (9,), generator=g).double()
    assert kendall_tau(a, b) == pytest.approx(_tau_b_pairs(a.tolist(), b.tolist()), abs=1e-12)


def test_rank_statistics_hand_values():
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 3.0, 2.0, 4.0])
    assert kendall_tau(a, b) == pytest.approx(4 / 6)  # 5 concordant, 1 discordant pair
    assert spearman_rho(a, b) == pytest.approx(1 - 6 * 2 / (4 * 15))  # sum d^2 = 2
    assert kendall_tau(a, -a) == pytest.approx(-1.0) and spearman_rho(a, a * 10) == pytest.approx(1.0)
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    assert math.isnan(kendall_tau(a, torch.ones(4))) and math.isnan(spearman_rho(a, torch.ones(4)))


@pytest.mark.parametrize("seed", range(4))
def test_spearman_matches_the_no_ties_closed_form(seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(12, generator=g), torch.randn(12, generator=g)
    d = average_ranks(a) - average_ranks(b)
    assert spearman_rho(a, b) == pytest.approx(1 - 6 * float((d * d).sum()) / (12 * (144 - 1)), abs=1e-12)


def test_rank_agreement_averages_rows_and_skips_constant_ones():
    low = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    high = torch.tensor([[1.0, 3.0, 2.0, 4.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    out = rank_agreement(low, high)
    assert out["kendall_tau"] == pytest.approx((4 / 6 - 1) / 2)
    assert out["spearman_rho"] == pytest.approx((0.8 - 1) / 2)


@pytest.mark.parametrize("mode", ["best_worst", "max_variance"])
def test_a_nonfinite_exploration_reward_is_taken_last_not_first(mode):
    rewards = torch.tensor([[0.1, float("nan"), 0.9, 0.5, 0.3, float("inf"), 0.7, 0.2]])
    chosen = select_subset(rewards, 4, mode)[0].tolist()
    assert 1 not in chosen and 5 not in chosen
    finite = rewards.clone()
    finite[0, 1] = finite[0, 5] = 0.4  # the finite median of the row: same choice
    assert select_subset(finite, 4, mode)[0].tolist() == chosen
