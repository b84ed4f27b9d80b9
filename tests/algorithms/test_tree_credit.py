"""BranchGRPO credit assignment on small hand-built trees: reward fusion, depth-wise
advantages (with the core estimators), width and depth pruning, and the closed-form
edge counts of the run plan."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffrl.algorithms.tree_credit import (
    depth_pruned_steps,
    fuse_rewards,
    trained_edge_counts,
    trained_edges,
    tree_credit,
    width_kept_leaves,
)
from diffrl.config import load_config
from diffrl.sampling.tree import TreeSpec, TreeTrajectory


def hand_tree(factors, num_trees=1, log_probs=None, kinds=None):
    """A TreeTrajectory with the layout of ``factors`` and the given per-node log-probs
    (latents are dummies: credit assignment reads only the structure and log-probs)."""
    spec = TreeSpec(tuple(factors))
    lay = spec.layout(num_trees)
    n = len(lay["depth"])
    lp = torch.zeros(n) if log_probs is None else torch.as_tensor(log_probs, dtype=torch.float32)
    stds = (lay["depth"] > 0).float()
    leaves = spec.leaves
    return TreeTrajectory(
        latents=torch.zeros(n, 1),
        means=torch.zeros(n, 1),
        log_probs=lp,
        stds=stds,
        std_ts=stds,
        noise=torch.zeros(n, 1),
        parent=lay["parent"],
        depth=lay["depth"],
        tree=lay["tree"],
        ordinal=lay["ordinal"],
        sigmas=torch.linspace(1, 0, len(factors) + 1),
        step_kinds=kinds or ["sde"] * len(factors),
        noise_levels=[0.7] * len(factors),
        spec=spec,
        root_keys=[(k,) for k in range(num_trees)],
        cond_rows=[k * leaves for k in range(num_trees)],
        keys=[(k, j) for k in range(num_trees) for j in range(leaves)],
    )


def tree_cfg(**tree):
    cfg = SimpleNamespace(
        reward_fusion="mean",
        fusion_temperature=1.0,
        width_pruning="none",
        width_keep_fraction=0.5,
        depth_pruning=[],
        depth_pruning_slide_every=0,
        depth_pruning_stop=0,
    )
    cfg.__dict__.update(tree)
    return cfg


# factors (2, 1, 2): depth 0 root; depth 1: A, B; depth 2: A', B'; depth 3: leaves a0 a1 b0 b1
LEAF_REWARDS = torch.tensor([1.0, 3.0, 2.0, 6.0])


def test_mean_fusion_matches_hand_values():
    tree = hand_tree((2, 1, 2))
    fused = fuse_rewards(tree, LEAF_REWARDS[:, None], "mean")[:, 0]
    # level-major: root | A B | A' B' | a0 a1 b0 b1
    assert fused.tolist() == [3.0, 2.0, 4.0, 2.0, 4.0, 1.0, 3.0, 2.0, 6.0]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_prob_weighted_fusion_matches_hand_values(temperature):
    # edge log-probs into: A=0, B=ln 4 | A'=0, B'=0 | a0=0, a1=ln 3, b0=0, b1=0
    lp = [0, 0, math.log(4), 0, 0, 0, math.log(3), 0, 0]
    tree = hand_tree((2, 1, 2), log_probs=lp)
    fused = fuse_rewards(tree, LEAF_REWARDS[:, None], "prob_weighted", temperature)[:, 0]
    w = 3 ** (1 / temperature)  # softmax([0, ln 3] / T) = [1, w] / (1 + w)
    a = (1 * 1 + w * 3) / (1 + w)
    b = 4.0  # equal log-probs: plain mean of 2 and 6
    u = 4 ** (1 / temperature)
    root = (a + u * b) / (1 + u)
    expected = [root, a, b, a, b, 1, 3, 2, 6]
    assert torch.allclose(fused, torch.tensor(expected, dtype=torch.float64), atol=1e-6)


def _credit(tree, leaf_total, components=None, weights=None, **overrides):
    cfg = load_config("tiny_toy_flowgrpo", [f"{k}={v}" for k, v in overrides.items()])
    comps = leaf_total[:, None] if components is None else components
    return tree_credit(tree, leaf_total, comps, cfg, 0, weights)


def test_depthwise_group_advantages_match_hand_values():
    tree = hand_tree((2, 1, 2))
    credit = _credit(tree, LEAF_REWARDS, **{"advantage.eps": 0.0})
    std3 = math.sqrt((4 + 0 + 1 + 9) / 4)  # leaves: mean 3
    expected = [0, -1, 1, -1, 1, -2 / std3, 0, -1 / std3, 3 / std3]  # depths 1, 2: [2, 4] -> mean 3, std 1
    assert torch.allclose(credit.advantages, torch.tensor(expected), atol=1e-6)
    assert credit.keep.tolist() == [False] + [True] * 8  # the root has no edge
    assert torch.allclose(credit.node_rewards, torch.tensor([3.0, 2, 4, 2, 4, 1, 3, 2, 6]))


def test_zero_std_depth_gives_zero_advantage_and_is_filtered():
    tree = hand_tree((2, 2))
    credit = _credit(tree, torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert (credit.advantages == 0).all() and not credit.keep.any()
    assert credit.filtered_fraction == 1.0
    unfiltered = _credit(tree, torch.tensor([5.0, 5.0, 5.0, 5.0]), **{"advantage.filter_zero_std": "false"})
    assert (unfiltered.advantages == 0).all() and unfiltered.keep[1:].all()


def test_trees_are_normalised_separately():
    tree = hand_tree((2, 1, 2), num_trees=2)
    no_eps = {"advantage.eps": 0.0}
    both = _credit(tree, torch.cat([LEAF_REWARDS, 10 * LEAF_REWARDS + 7]), **no_eps)
    single = _credit(hand_tree((2, 1, 2)), LEAF_REWARDS, **no_eps)
    first = tree.tree == 0
    assert torch.allclose(both.advantages[first], single.advantages, atol=1e-5)
    assert torch.allclose(both.advantages[~first], single.advantages, atol=1e-5)  # affine-invariant


def test_median_estimator_composes_per_depth():
    tree = hand_tree((4,))
    credit = _credit(
        tree, torch.tensor([1.0, 2.0, 4.0, 9.0]), **{"advantage.estimator": "median", "advantage.eps": 0.0}
    )
    r = torch.tensor([1.0, 2.0, 4.0, 9.0])
    expected = (r - 3.0) / r.std(unbiased=False)  # median of an even group: mean of the middle pair
    assert torch.allclose(credit.advantages[1:], expected, atol=1e-6)


def test_decoupled_estimator_composes_per_depth():
    """GDPO per (tree, depth): normalise each fused component per group, weight, sum,
    then normalise the sum over every non-root node."""
    tree = hand_tree((2, 2))
    comps = torch.tensor([[1.0, 0.0], [2.0, 1.0], [4.0, 1.0], [3.0, 5.0]])
    weights = torch.tensor([1.0, 0.5])
    total = comps @ weights
    credit = _credit(
        tree, total, comps, weights, **{"advantage.estimator": "decoupled", "advantage.eps": 0.0}
    )
    fused = fuse_rewards(tree, comps, "mean")

    def znorm(x):
        return (x - x.mean()) / x.std(unbiased=False)

    summed = []
    for d in (1, 2):
        at = tree.depth == d
        summed.append(sum(weights[k] * znorm(fused[at, k]) for k in range(2)))
    summed = torch.cat(summed)
    expected = znorm(summed)
    assert torch.allclose(credit.advantages[1:].double(), expected, atol=1e-5)


def test_best_worst_width_pruning_keeps_exactly_the_extreme_leaves():
    # factors (2, 2, 1, 1): last split at step 1, edges at steps 2 and 3 follow single leaves
    tree = hand_tree((2, 2, 1, 1))
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    kept = width_kept_leaves(tree, rewards, "best_worst", 0.5)
    assert kept.tolist() == [True, False, False, True]
    mask = trained_edges(tree, tree_cfg(width_pruning="best_worst"), 0, rewards)
    step = tree.depth - 1
    after = step > 1
    leaf_of = tree.ordinal
    assert mask[~after & (tree.depth > 0)].all()  # up to and including the last split: all edges
    assert mask[after].tolist() == [bool(kept[j]) for j in leaf_of[after].tolist()]
    assert int(mask.sum()) == 2 + 4 + 2 + 2


def test_width_pruning_maps_post_split_edges_to_their_own_tree_and_leaf():
    tree = hand_tree((2, 2, 1), num_trees=2)
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0, 9.0, 0.0, 5.0, 4.0])  # tree 1: best leaf 0, worst leaf 1
    mask = trained_edges(tree, tree_cfg(width_pruning="best_worst"), 0, rewards)
    last = tree.depth == 3  # the only step after the last split (step 2)
    expected = {(0, 0), (0, 3), (1, 0), (1, 1)}  # (tree, leaf ordinal) kept
    got = {(int(k), int(j)) for k, j, m in zip(tree.tree[last], tree.ordinal[last], mask[last]) if m}
    assert got == expected


def test_best_per_branch_keeps_the_best_sibling():
    tree = hand_tree((2, 2, 1))
    kept = width_kept_leaves(tree, torch.tensor([1.0, 3.0, 6.0, 2.0]), "best_per_branch", 0.5)
    assert kept.tolist() == [False, True, True, False]


def test_depth_pruning_slides_to_the_stop_step():
    cfg = tree_cfg(depth_pruning=[15, 16, 17, 18], depth_pruning_slide_every=30, depth_pruning_stop=9)
    assert depth_pruned_steps(cfg, 0) == {15, 16, 17, 18}
    assert depth_pruned_steps(cfg, 59) == {14, 15, 16, 17}
    assert depth_pruned_steps(cfg, 10_000) == {9, 10, 11, 12}
    assert depth_pruned_steps(tree_cfg(depth_pruning=[3]), 10_000) == {3}


def test_trunk_ode_and_pruned_edges_are_not_trained():
    kinds = ["sde", "sde", "sde", "ode", "sde"]
    tree = hand_tree((1, 2, 2, 1, 1), kinds=kinds)
    mask = trained_edges(tree, tree_cfg(depth_pruning=[2]), 0, torch.arange(4.0))
    trained_steps = sorted(set((tree.depth[mask] - 1).tolist()))
    assert trained_steps == [1, 4]  # step 0: trunk (one node); 2: pruned; 3: ODE


@pytest.mark.parametrize(
    "factors,kinds,options",
    [
        ((2, 1, 2, 1), None, {}),
        ((1, 2, 2, 1, 1), ["sde", "sde", "sde", "ode", "sde"], {"depth_pruning": [2]}),
        ((2, 2, 1, 1), None, {"width_pruning": "best_worst", "width_keep_fraction": 0.5}),
        ((2, 3, 1, 1), None, {"width_pruning": "best_per_branch", "width_keep_fraction": 0.34}),
        ((4, 2, 1), None, {"width_pruning": "best_worst", "width_keep_fraction": 0.25, "depth_pruning": [0]}),
    ],
)
def test_closed_form_edge_counts_match_the_mask(factors, kinds, options):
    tree = hand_tree(factors, num_trees=3, kinds=kinds)
    cfg = tree_cfg(**options)
    rewards = torch.randn(tree.num_leaves, generator=torch.Generator().manual_seed(0))
    mask = trained_edges(tree, cfg, 0, rewards)
    per_step = torch.bincount(tree.depth[mask] - 1, minlength=len(factors)).tolist()
    assert per_step == [3 * c for c in trained_edge_counts(tree.spec, tree.step_kinds, cfg, 0)]


def test_zero_variance_share_matches_a_per_group_loop():
    """The vectorised share of flat (tree, depth) groups equals the plain loop over groups
    (single-node groups are structural and not counted)."""
    from diffrl.algorithms.tree_credit import _zero_variance_share, multi_node

    gen = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 12, (200,), generator=gen)
    values = torch.randint(0, 3, (200,), generator=gen).double()
    values[groups == 4] = 1.0  # at least one flat group
    values[groups == 5] = torch.tensor([0.5, 0.5 + 1e-12], dtype=torch.float64).repeat(100)[
        : int((groups == 5).sum())
    ]
    multi = multi_node(groups)
    ids = torch.unique(groups[multi]).tolist()
    flat = [g for g in ids if (values[groups == g] == values[groups == g][0]).all()]
    assert 4 in flat and 5 not in flat
    assert _zero_variance_share(values, groups) == pytest.approx(len(flat) / len(ids))
    assert _zero_variance_share(values, torch.arange(5)) == 0.0  # every group a single node
