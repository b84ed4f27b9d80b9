"""The BranchGRPO tree sampler: equivalence with independent rollouts, exact path
replay, shared roots, the node layout, NFE accounting and SDE windows."""

import math

import pytest
import torch

from diffrl.config import ConfigError, load_config
from diffrl.models import build_adapter
from diffrl.sampling import TreeSpec, rollout_independent, rollout_tree
from diffrl.sampling.rollout import denoise
from diffrl.sampling.windows import sde_window_at, step_kinds


def _cfg(family="toy", *overrides):
    return load_config(f"tiny_{family}_flowgrpo", list(overrides))


def _keys(prompts: int, leaves: int):
    return [(0, 3, g, s) for g in range(prompts) for s in range(leaves)]


@pytest.mark.parametrize("family", ["toy", "flux"])
def test_branching_factor_one_equals_independent_bit_for_bit(family):
    cfg = _cfg(family)
    adapter = build_adapter(cfg.model)
    keys = _keys(3, 1)  # one single-path tree per prompt
    cond = adapter.encode_prompts(["a red circle", "two blue squares", "a cat"])
    spec = TreeSpec.build(cfg.sampling.num_steps, [0], [1])
    tree = rollout_tree(adapter, adapter.transformer, cond, keys, cfg, spec=spec)
    ind = rollout_independent(adapter, adapter.transformer, cond, keys, cfg, keep_noise=True)
    paths = tree.path_trajectory()
    for name in ("latents", "means", "log_probs", "stds", "step_noise"):
        assert torch.equal(getattr(paths, name), getattr(ind, name)), name
    assert torch.equal(tree.images, ind.images)
    assert tree.nfe == ind.nfe == 3 * cfg.sampling.num_steps


def _toy_tree(split_steps=(0, 1, 2), factors=(2,), prompts=2, scale=1.0, *overrides):
    leaves = math.prod(list(factors) * len(split_steps) if len(factors) == 1 else factors)
    cfg = _cfg(
        "toy",
        "rollout.strategy=tree",
        f"rollout.group_size={leaves}",
        f"tree.split_steps={list(split_steps)}",
        f"tree.branch_factors={list(factors)}",
        f"tree.split_noise_scale={scale}",
        "rollout.batch_size=5",
        *overrides,
    )
    adapter = build_adapter(cfg.model)
    prompts_text = ["a red circle", "two blue squares", "a green triangle"][:prompts]
    cond = adapter.encode_prompts([p for p in prompts_text for _ in range(leaves)])
    return cfg, adapter, cond, rollout_tree(adapter, adapter.transformer, cond, _keys(prompts, leaves), cfg)


@pytest.mark.parametrize("split_noise", ["level", "draw"])
def test_replaying_every_stored_path_reproduces_its_leaf(split_noise):
    """Stored root noise + per-edge noise through the independent sampler give the leaf
    latent and the same per-step log-probs. The replay batches 16 paths per forward where
    the tree ran 2..16 rows in chunks of 5, so float32 GEMM blocking differs: equality is
    to ~1e-6 relative, not bitwise (bitwise holds with matching batches, test above)."""
    cfg, adapter, cond, tree = _toy_tree((0, 1, 2), (2,), 2, 2.0, f"tree.split_noise={split_noise}")
    paths = tree.path_trajectory()
    replay = denoise(
        adapter,
        adapter.transformer,
        cond,
        paths.keys,
        tree.sigmas,
        tree.step_kinds,
        tree.noise_levels,
        cfg.objective.logprob_reduction,
        init_noise=paths.latents[:, 0],
        noise=paths.step_noise,
    )
    torch.testing.assert_close(replay.latents, paths.latents, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(replay.log_probs, paths.log_probs, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(replay.latents[:, -1], tree.latents[tree.leaf_nodes()], rtol=1e-5, atol=2e-5)
    assert not torch.allclose(paths.latents[0, -1], paths.latents[1, -1], atol=1e-2)  # the check can fail


def test_leaves_share_the_root_and_siblings_differ_after_a_split():
    _, _, _, tree = _toy_tree(split_steps=(1, 3), factors=(3, 2), prompts=2)
    paths = tree.paths()  # (L, T+1) node ids
    assert paths.shape == (12, 5)
    for k in range(2):
        rows = paths[6 * k : 6 * (k + 1)]
        assert (rows[:, 0] == rows[0, 0]).all() and (
            rows[:, 1] == rows[0, 1]
        ).all()  # trunk until the first split
        assert len(set(rows[:, 2].tolist())) == 3 and len(set(rows[:, 4].tolist())) == 6
    leaves = tree.latents[tree.leaf_nodes()]
    assert len({tuple(x.flatten()[:4].tolist()) for x in leaves}) == 12  # all leaves distinct
    root_noise = tree.noise[tree.depth == 0]
    assert not torch.equal(root_noise[0], root_noise[1])  # trees of different prompts do not share noise


def test_layout_parents_follow_the_closed_form():
    spec = TreeSpec.build(6, [0, 2, 5], [2, 3, 2])
    lay = spec.layout(num_trees=3)
    assert spec.leaves == 12 and len(lay["depth"]) == 3 * sum(spec.nodes_at(d) for d in range(7))
    child = lay["depth"] > 0
    par = lay["parent"][child]
    assert (lay["depth"][par] == lay["depth"][child] - 1).all() and (
        lay["tree"][par] == lay["tree"][child]
    ).all()
    # every node at depth d has exactly factors[d] children
    counts = torch.bincount(par, minlength=len(lay["depth"]))
    for d in range(6):
        assert (counts[lay["depth"] == d] == spec.factors[d]).all()


@pytest.mark.parametrize(
    "steps,splits,factors,expected",
    [
        (20, [0, 3, 6, 9], [2], 1 + 3 * 2 + 3 * 4 + 3 * 8 + 10 * 16),  # BranchGRPO's FLUX schedule
        (10, [0, 2, 4, 6], [2], 1 + 2 * 2 + 2 * 4 + 2 * 8 + 3 * 16),
        (8, [3], [4], 4 * 1 + 4 * 4),
        (5, [1, 2], [3, 2], 1 + 1 + 3 + 6 * 2),
    ],
)
def test_nfe_closed_form(steps, splits, factors, expected):
    assert TreeSpec.build(steps, splits, factors).nfe_per_tree() == expected


@pytest.mark.parametrize("splits,factors", [((0, 1, 2), (2,)), ((1, 3), (3, 2)), ((2,), (4,))])
def test_measured_nfe_equals_closed_form(splits, factors, monkeypatch):
    """Count the rows that actually reach the transformer."""
    cfg = _cfg("toy", "model.guidance_scale=1.0")
    adapter = build_adapter(cfg.model)
    rows = []
    forward = adapter.transformer.forward

    def counting(*args, **kwargs):
        rows.append(kwargs["hidden_states"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(adapter.transformer, "forward", counting)
    spec = TreeSpec.build(cfg.sampling.num_steps, splits, factors)
    cond = adapter.encode_prompts(["a red circle"] * spec.leaves * 2)
    tree = rollout_tree(adapter, adapter.transformer, cond, _keys(2, spec.leaves), cfg, spec=spec)
    assert sum(rows) == tree.nfe == 2 * spec.nfe_per_tree()
    assert tree.nfe / tree.num_leaves == spec.nfe_per_tree() / spec.leaves


def test_split_noise_scale_scales_the_split_std_only():
    _, _, _, base = _toy_tree(split_steps=(1,), factors=(4,), prompts=1)
    _, _, _, scaled = _toy_tree(split_steps=(1,), factors=(4,), prompts=1, scale=3.0)
    assert (
        scaled.noise_levels[1] == 3 * base.noise_levels[1] and scaled.noise_levels[0] == base.noise_levels[0]
    )
    at_split = scaled.depth == 2
    assert torch.allclose(scaled.std_ts[at_split], 3 * base.std_ts[at_split])
    assert torch.equal(scaled.latents[scaled.depth <= 1], base.latents[base.depth <= 1])  # before the split


def test_split_noise_draw_scales_only_the_drawn_noise_as_branchgrpo_does():
    _, _, _, base = _toy_tree(split_steps=(1,), factors=(4,), prompts=1)
    _, _, _, drawn = _toy_tree((1,), (4,), 1, 3.0, "tree.split_noise=draw")
    at_split = drawn.depth == 2
    assert drawn.noise_levels == base.noise_levels  # drift and log-prob keep the unscaled std
    assert torch.equal(drawn.stds[at_split], base.stds[at_split])
    assert torch.equal(drawn.means[at_split], base.means[at_split])
    torch.testing.assert_close(
        drawn.latents[at_split] - drawn.means[at_split],
        3 * (base.latents[at_split] - base.means[at_split]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_tree_keys_must_come_in_whole_groups():
    cfg, adapter, cond, _ = _toy_tree()
    with pytest.raises(ValueError, match="consecutive samples per prompt"):
        rollout_tree(adapter, adapter.transformer, cond, _keys(2, 8)[1:] + [(0, 3, 9, 0)], cfg)


def test_sliding_sde_window_and_split_steps_stay_stochastic():
    cfg = _cfg(
        "toy",
        "sampling.num_steps=10",
        "sampling.sde_window=[0,3]",
        "sampling.sde_window_slide_every=5",
        "sampling.sde_window_slide_stride=2",
    )
    assert [sde_window_at(cfg.sampling, 10, it) for it in (0, 4, 5, 10, 15, 100)] == [
        (0, 3),
        (0, 3),
        (2, 5),
        (4, 7),
        (6, 9),
        (7, 10),
    ]
    kinds = step_kinds(cfg.sampling, 10, 5, always_sde=[8])
    assert [t for t, k in enumerate(kinds) if k != "ode"] == [2, 3, 4, 8]
    static = _cfg("toy", "sampling.num_steps=10", "sampling.sde_window=[0,3]")
    assert sde_window_at(static.sampling, 10, 1000) == (0, 3)


def test_independent_rollout_follows_the_sliding_window():
    cfg = _cfg("toy", "sampling.sde_window=[0,2]", "sampling.sde_window_slide_every=1")
    adapter = build_adapter(cfg.model)
    cond = adapter.encode_prompts(["a red circle"] * 2)
    traj = rollout_independent(adapter, adapter.transformer, cond, _keys(1, 2), cfg, iteration=1)
    assert traj.trainable_steps() == [1, 2]


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.group_size=4", "product of tree.branch_factors"),
        ("tree.split_steps=[3,1]", "increasing step indices"),
        ("tree.branch_factors=[2,2]", "one per split step"),
        ("sampling.sde_type=ode", "stochastic step"),
        ("tree.depth_pruning=[7]", "depth_pruning"),
        ("tree.depth_pruning_stop=-1", "depth_pruning_stop"),
        ("sampling.sde_type=cps", "noise_level \\* tree.split_noise_scale"),  # a = 0.7 x scale 2 > 1
        ("objective.logprob_reduction=sum", "prob_weighted needs"),
    ],
)
def test_tree_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(
            "toy",
            "rollout.strategy=tree",
            "rollout.group_size=8",
            "tree.split_steps=[0,1,2]",
            "tree.split_noise_scale=2.0",
            "tree.reward_fusion=prob_weighted",
            override,
        )


def test_on_policy_ratio_is_one_on_every_tree_edge_including_scaled_splits():
    from diffrl.algorithms.flow_grpo import flow_grpo_loss
    from diffrl.algorithms.objective import LossContext, StepBatch

    cfg, adapter, cond, tree = _toy_tree(split_steps=(0, 2), factors=(2,), scale=3.0)

    def velocity(x, s, c):
        return adapter.velocity(adapter.transformer, x, s, c)

    ctx = LossContext(velocity, None, cfg.objective, cfg.sampling.noise_level)
    for t in range(tree.num_steps):
        rows = torch.nonzero(tree.depth == t + 1).flatten().tolist()
        x_t, x_next, old, cond_rows = tree.transition(rows, t)
        for level, on_policy in ((tree.noise_levels[t], True), (cfg.sampling.noise_level, t not in (0, 2))):
            batch = StepBatch(
                x_t,
                x_next,
                tree.sigmas[t],
                tree.sigmas[t + 1],
                float(tree.sigmas[1]),
                tree.step_kinds[t],
                old,
                torch.ones(len(rows)),
                cond.select(cond_rows),
                noise_level=level,
            )
            with torch.no_grad():
                _, stats = flow_grpo_loss(ctx, batch)
            assert (abs(stats["ratio"].item() - 1) < 1e-5) == on_policy, (t, level)


def test_shared_root_noise_gives_consecutive_trees_one_root_as_branchgrpo_does():
    """tree.shared_root_noise N: the trees of N consecutive prompts start from one noise
    (BranchGRPO's init_same_noise, the trees one GPU grows in a call); their branches,
    keyed per tree, still differ."""
    from diffrl.sampling.tree import root_noise_keys

    assert root_noise_keys([(0, 3, 0), (0, 3, 1), (0, 3, 2)], 2) == [(0, 3, 0, 0), (0, 3, 0, 0), (0, 3, 2, 0)]
    assert root_noise_keys([(0, 3, 1)]) == [(0, 3, 1, 0)]
    roots = {}
    for shared in (1, 2):
        cfg, adapter, cond, tree = _toy_tree((0, 1), (2,), 3, 1.0, f"tree.shared_root_noise={shared}")
        start = tree.latents[tree.depth == 0]  # one root per tree, in tree order
        roots[shared] = start
        leaves = tree.latents[tree.depth == tree.num_steps]
        assert not torch.equal(leaves[0], leaves[4])  # trees 0 and 1 branch differently
    assert torch.equal(roots[2][0], roots[2][1]) and not torch.equal(roots[2][0], roots[2][2])
    assert torch.equal(roots[2][2], roots[1][2]) and not torch.equal(roots[1][0], roots[1][1])
