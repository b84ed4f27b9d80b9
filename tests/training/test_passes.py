"""Pass plans: every trained edge once per epoch, shares that average each optimizer
step, a pass count that depends only on per-step edge counts (so DDP processes agree),
and the independent plan's optimizer-step count."""

from fractions import Fraction

import pytest
import torch

from diffrl.config import load_config
from diffrl.sampling import TreeSpec
from diffrl.training.passes import edge_major, optimizer_steps_per_epoch, sample_major, step_edge_counts
from diffrl.training.plan import derive


def _cfg(*overrides):
    return load_config("toy_branchgrpo", list(overrides))


def _mask(seed: int):
    """A random trained-edge mask with 40 edges at every step of a 16-tree layout."""
    lay = TreeSpec.build(10, [0, 1, 2, 3], [2]).layout(16)
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lay["depth"]), dtype=torch.bool)
    for d in range(1, 11):
        idx = torch.nonzero(lay["depth"] == d).flatten()
        mask[idx[torch.randperm(len(idx), generator=g)[:40]]] = True
    return mask, lay["depth"]


@pytest.mark.parametrize("weighting", ["edge", "depth"])
def test_edge_plan_covers_every_edge_once_with_shares_summing_to_one(weighting):
    cfg = _cfg(
        "train.micro_batch_size=4", "train.gradient_accumulation=8", f"tree.loss_weighting={weighting}"
    )
    mask, depth = _mask(0)
    groups = edge_major(mask, depth, 256, cfg, step=7, epoch=1)
    assert len(groups) == optimizer_steps_per_epoch(256, cfg) == 8
    assert max(len(p.rows) for g in groups for p in g) == 4  # 40 edges per step / 8 groups, in chunks of 4
    rows = sorted(r for g in groups for p in g for r in p.rows)
    assert rows == torch.nonzero(mask).flatten().tolist()
    for g in groups:
        assert sum(Fraction(*p.share) for p in g) == 1
        assert all(len(p.rows) <= 4 and set((depth[p.rows] - 1).tolist()) == {p.t} for p in g)
        if weighting == "depth":  # every step present in the group weighs the same
            per_step = {}
            for p in g:
                per_step[p.t] = per_step.get(p.t, 0) + Fraction(*p.share)
            assert len(set(per_step.values())) == 1


def test_pass_structure_depends_only_on_per_step_counts():
    cfg = _cfg("train.micro_batch_size=4", "train.gradient_accumulation=8")
    a = edge_major(*_mask(0), 256, cfg, 3, 0)
    b = edge_major(*_mask(1), 256, cfg, 3, 0)
    assert [[(len(p.rows), p.t, p.share) for p in g] for g in a] == [
        [(len(p.rows), p.t, p.share) for p in g] for g in b
    ]


def test_timestep_fraction_keeps_that_share_of_each_step():
    cfg = _cfg("objective.timestep_fraction=0.4", "train.micro_batch_size=64")
    mask, depth = _mask(0)
    rows = [r for g in edge_major(mask, depth, 256, cfg, 0, 0) for p in g for r in p.rows]
    # step 0 has only 32 edges (2 nodes x 16 trees): ceil(0.4 * 32) = 13; the others 0.4 * 40
    assert torch.bincount(depth[rows] - 1, minlength=10).tolist() == [13] + [16] * 9


def test_sample_plan_steps_once_per_accumulated_micro_batches():
    cfg = load_config("toy_flowgrpo", ["train.micro_batch_size=16", "train.gradient_accumulation=3"])
    groups = sample_major(100, [0, 1, 2, 3], cfg, 0, 0)
    assert len(groups) == optimizer_steps_per_epoch(100, cfg) == 3
    assert sorted(r for g in groups for p in g if p.t == 0 for r in p.rows) == list(range(100))


def test_samples_train_in_rollout_order_without_the_shuffle():
    """train.shuffle_samples false (DanceGRPO): optimizer step k trains samples
    4k..4k+3 in order, each forwarded alone on its own keyed draw of steps at micro-batch 1;
    the default shuffles."""
    sets = ["train.micro_batch_size=1", "train.gradient_accumulation=4", "objective.timestep_fraction=0.5"]
    in_order = sample_major(
        8, list(range(8)), load_config("toy_flowgrpo", [*sets, "train.shuffle_samples=false"]), 0, 0
    )
    assert [list(dict.fromkeys(p.rows[0] for p in g)) for g in in_order] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(len(p.rows) == 1 for g in in_order for p in g)
    draws = {}
    for p in (p for g in in_order for p in g):
        draws.setdefault(p.rows[0], set()).add(p.t)
    assert all(len(d) == 4 for d in draws.values()) and len({frozenset(d) for d in draws.values()}) > 1
    shuffled = sample_major(8, list(range(8)), load_config("toy_flowgrpo", sets), 0, 0)
    assert [p.rows[0] for g in shuffled for p in g][::4] != list(range(8))


@pytest.mark.parametrize("weighting", ["edge", "depth"])
def test_masked_edges_weigh_as_zero_losses(weighting):
    """The objective averages over a pass's kept rows; shares of kept / all edges make
    every kept edge of a step weigh 1 / (edges), whatever the pass composition."""
    cfg = _cfg(
        "train.micro_batch_size=4", "train.gradient_accumulation=8", f"tree.loss_weighting={weighting}"
    )
    mask, depth = _mask(0)
    keep = torch.rand(len(mask), generator=torch.Generator().manual_seed(1)) > 0.3
    for g in edge_major(mask, depth, 256, cfg, 0, 0, keep):
        edges = {t: sum(len(p.rows) for p in g if p.t == t) for t in {p.t for p in g}}
        for p in g:
            kept = int(keep[p.rows].sum())
            assert p.share[0] == kept
            assert p.row_weights().tolist() == keep[p.rows].float().tolist()  # the loss sees keep
            per_edge = (
                Fraction(1, edges[p.t] * len(edges))
                if weighting == "depth"
                else Fraction(1, sum(edges.values()))
            )
            assert Fraction(*p.share) == kept * per_edge


def _thinned(mask, depth, seed):
    """``mask`` with a random third of each step's edges removed: a sub-tree-like shape."""
    g = torch.Generator().manual_seed(seed)
    out = mask.clone()
    for d in range(1, 11):
        idx = torch.nonzero(mask & (depth == d)).flatten()
        out[idx[torch.randperm(len(idx), generator=g)[: len(idx) // 3 + (d + seed) % 3]]] = False
    return out


@pytest.mark.parametrize("weighting", ["edge", "depth"])
def test_padding_gives_processes_one_pass_structure_and_leaves_live_rows_alone(weighting):
    """Two processes with differently shaped trees (Sol-RL sub-trees): padded to the per-step
    maximum, both get the same passes of the same sizes; dead rows sit at the right depth,
    and the live rows carry exactly the shares the unpadded plan gives them."""
    cfg = _cfg(
        "train.micro_batch_size=4", "train.gradient_accumulation=8", f"tree.loss_weighting={weighting}"
    )
    mask, depth = _mask(3)
    a, b = _thinned(mask, depth, 0), _thinned(mask, depth, 1)
    counts_a, counts_b = step_edge_counts(a, depth, cfg), step_edge_counts(b, depth, cfg)
    assert counts_a != counts_b
    pad = {t: max(counts_a.get(t, 0), counts_b.get(t, 0)) for t in set(counts_a) | set(counts_b)}
    plans = [edge_major(m, depth, 256, cfg, 5, 0, pad_to=pad) for m in (a, b)]
    shape = [[(p.t, len(p.rows)) for p in g] for g in plans[0]]
    assert shape == [[(p.t, len(p.rows)) for p in g] for g in plans[1]]
    for m, plan in zip((a, b), plans):
        live_rows = []
        for g in plan:
            live_share, group_live = Fraction(0), 0
            for p in g:
                live = p.counted or [True] * len(p.rows)
                assert all(int(depth[r]) - 1 == p.t for r in p.rows)  # dead rows repeat a node of that depth
                assert p.share[0] == sum(live)  # keep is all True here: the numerator counts live rows only
                live_rows += [r for r, alive in zip(p.rows, live) if alive]
                live_share, group_live = live_share + Fraction(*p.share), group_live + sum(live)
            assert live_share == (1 if group_live else 0)  # each optimizer step averages its live edges
        assert sorted(live_rows) == torch.nonzero(m).flatten().tolist()  # every live edge once


@pytest.mark.parametrize("weighting", ["edge", "depth"])
def test_mean_counts_weigh_every_live_edge_of_all_processes_alike(weighting):
    """Two processes with differently shaped sub-trees; DDP/FSDP average their gradients,
    so a live row's weight in the optimizer step is 1 / (P * den). With the mean live
    counts as denominators, the edges of both processes weigh as one process's would:
    equally (``edge``), or equally within a step with every live step weighing the same
    (``depth``). Reference: the weights counted directly from the two masks."""
    cfg = _cfg(
        "train.micro_batch_size=4", "train.gradient_accumulation=8", f"tree.loss_weighting={weighting}"
    )
    mask, depth = _mask(3)
    masks = (_thinned(mask, depth, 0), _thinned(mask, depth, 1))
    counts = [step_edge_counts(m, depth, cfg) for m in masks]
    pad = {t: max(c.get(t, 0) for c in counts) for t in set(counts[0]) | set(counts[1])}
    recorded = []  # each process's local live counts, captured by a first planning
    for m in masks:
        edge_major(
            m, depth, 256, cfg, 5, 0, pad_to=pad, mean_over_processes=lambda c: recorded.append(c) or c
        )
    mean = [(a + b) / 2 for a, b in zip(*recorded, strict=True)]
    plans = [
        edge_major(m, depth, 256, cfg, 5, 0, pad_to=pad, mean_over_processes=lambda _c: mean) for m in masks
    ]
    for groups in zip(*plans, strict=True):  # the same optimizer step on both processes
        weight = {}  # (process, row) -> its weight in the averaged gradient
        for proc, group in enumerate(groups):
            for p in group:
                for row, alive in zip(p.rows, p.counted or [True] * len(p.rows), strict=True):
                    if alive:
                        weight[proc, row] = 1 / (2 * Fraction(p.share[1]))
        steps = {(proc, row): int(depth[row]) - 1 for proc, row in weight}
        assert sum(weight.values()) == 1
        if weighting == "edge":
            assert len(set(weight.values())) == 1
        else:
            live_steps = set(steps.values())
            for t in live_steps:
                at_t = [w for key, w in weight.items() if steps[key] == t]
                assert len(set(at_t)) == 1 and sum(at_t) == Fraction(1, len(live_steps))


def test_sample_major_carries_keep_as_row_weights_of_policy_and_anchor_passes():
    """Masked samples are still forwarded (every process runs the same passes) but
    weigh 0 in the loss; the shares do not change, so a masked sample is a zero loss."""
    cfg = _cfg("train.micro_batch_size=4", "train.gradient_accumulation=2", "objective.anchor_fraction=0.5")
    keep = torch.arange(16) % 3 != 0
    plain = sample_major(16, [0, 1, 2, 3], cfg, 2, 0, [4, 5])
    masked = sample_major(16, [0, 1, 2, 3], cfg, 2, 0, [4, 5], keep)
    assert any(p.anchor for g in masked for p in g)
    for g_plain, g_masked in zip(plain, masked, strict=True):
        for p, q in zip(g_plain, g_masked, strict=True):
            assert (p.rows, p.t, p.share, p.anchor) == (q.rows, q.t, q.share, q.anchor)
            assert p.row_weights().tolist() == [1.0] * len(p.rows)
            assert q.row_weights().tolist() == [float(keep[r]) for r in q.rows]


@pytest.mark.parametrize("selection", ["random", "first"])
def test_timestep_selection_first_trains_flow_grpo_s_steps(selection):
    """0.99 of 10 steps: 9 per sample either way; ``first`` always steps 0-8 (flow_grpo's
    ``range(num_train_timesteps)``), ``random`` leaves out varying steps, the last one
    included sometimes."""
    cfg = load_config(
        "toy_flowgrpo",
        [
            "objective.timestep_fraction=0.99",
            f"objective.timestep_selection={selection}",
            "train.micro_batch_size=4",
            "train.gradient_accumulation=1",
        ],
    )
    groups = sample_major(64, list(range(10)), cfg, 0, 0)
    per_batch = [sorted({p.t for p in g}) for g in groups]
    assert all(len(steps) == 9 for steps in per_batch)
    if selection == "first":
        assert all(steps == list(range(9)) for steps in per_batch)
    else:
        assert any(9 in steps for steps in per_batch) and len({tuple(s) for s in per_batch}) > 1


def test_first_timesteps_are_refused_for_trees():
    from diffrl.config import ConfigError

    with pytest.raises(ConfigError, match="first is for independent rollouts"):
        _cfg("objective.timestep_selection=first")


def test_edges_per_step_steps_the_optimizer_as_branchgrpo_does():
    """BranchGRPO steps after every N trained edges: 392 edges (32 at step 0, 40 at each
    of the 9 others) at N = 12 make ceil(392 / 12) = 33 optimizer steps of about 12 edges
    each, every edge once, where the leaves alone make 8."""
    mask, depth = _mask(0)
    base = ("train.micro_batch_size=4", "train.gradient_accumulation=8")
    assert len(edge_major(mask, depth, 256, _cfg(*base), 0, 0)) == 8
    groups = edge_major(mask, depth, 256, _cfg(*base, "tree.edges_per_step=12"), 0, 0)
    sizes = [sum(len(p.rows) for p in g) for g in groups]
    assert len(groups) == 33 and sum(sizes) == 392 and max(sizes) - min(sizes) <= 10
    assert sorted(r for g in groups for p in g for r in p.rows) == torch.nonzero(mask).flatten().tolist()
    for g in groups:
        assert sum(Fraction(*p.share) for p in g) == 1
    plan = derive(_cfg(*base, "tree.edges_per_step=12"))
    assert plan["optimizer_steps_per_iteration"] > derive(_cfg(*base))["optimizer_steps_per_iteration"]


# -- advantage.drop_zero: flow_grpo's layout of the samples that train ---------------------
def _flow_grpo_layout(keep: list[bool], refill_pick: list[int], n_batches: int, order: list[int]):
    """flow_grpo's scripts/train_sd3.py (ac4c86e) after the advantages, written out: the mask
    of nonzero advantages, topped up to a multiple of num_batches_per_epoch with the given
    picks among the False entries (its torch.randperm), then the kept samples in the
    shuffled order, reshaped into num_batches_per_epoch equal micro-batches."""
    mask = list(keep)
    short = (n_batches - sum(mask) % n_batches) % n_batches
    false_indices = [i for i, m in enumerate(mask) if not m]
    if short and len(false_indices) >= short:
        for i in refill_pick[:short]:
            mask[false_indices[i]] = True
    rows = [i for i in order if mask[i]]
    size = len(rows) // n_batches
    return [rows[k * size : (k + 1) * size] for k in range(n_batches)]


def test_dropped_layout_is_flow_grpo_s_and_refills_the_same_in_every_epoch():
    from diffrl.sampling import rng
    from diffrl.training.passes import dropped_layout

    keep = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0], dtype=torch.bool)  # 7 kept
    refill = ~keep  # every zero-advantage sample may come back
    order = torch.randperm(12, generator=torch.Generator().manual_seed(3)).tolist()
    batches, counted = dropped_layout(order, keep, refill, 4, seed=0, step=5)
    pick = torch.randperm(5, generator=rng.generator(0, "refill", 5)).tolist()
    assert batches == _flow_grpo_layout(keep.tolist(), pick, 4, order)
    assert [len(b) for b in batches] == [2, 2, 2, 2] and counted == [None] * 4  # 7 + 1 refilled
    again, _ = dropped_layout(list(reversed(order)), keep, refill, 4, seed=0, step=5)  # another epoch
    assert sorted(i for b in again for i in b) == sorted(i for b in batches for i in b)


def test_dropped_layout_without_enough_refill_keeps_the_kept_and_never_stalls():
    from diffrl.training.passes import dropped_layout

    keep = torch.tensor([1, 1, 1, 0, 0], dtype=torch.bool)
    refill = torch.tensor([0, 0, 0, 1, 0], dtype=torch.bool)  # 1 may come back, 1 is needed for 4
    batches, counted = dropped_layout([0, 1, 2, 3, 4], keep, refill, 2, seed=0, step=0)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3] and counted == [None, None]
    batches, counted = dropped_layout([4, 3, 2, 1, 0], keep, refill & False, 2, seed=0, step=0)
    assert sorted(len(b) for b in batches) == [1, 2]  # 3 over 2: as even as it goes
    nothing = torch.zeros(5, dtype=torch.bool)
    batches, counted = dropped_layout([2, 0, 1, 3, 4], nothing, nothing, 3, seed=0, step=0)
    assert batches == [[2], [2], [2]] and counted == [[False]] * 3  # one dead row a micro-batch


def test_sample_major_with_drop_zero_forwards_no_zero_advantage_sample():
    cfg = load_config("tiny_flux_flowgrpo", ["train.micro_batch_size=4", "train.gradient_accumulation=1"])
    keep = torch.tensor([True, False] * 6)  # 12 samples, 6 zero advantages, 3 micro-batches
    plan = sample_major(12, [0, 1], cfg, step=0, epoch=0, keep=keep, refill=~keep)
    rows = [r for group in plan for p in group for r in p.rows]
    assert set(rows) == set(range(0, 12, 2)) and all(p.counted is None for g in plan for p in g)
    assert len(plan) == 3 and all(len(p.rows) == 2 for g in plan for p in g)
    masked = sample_major(12, [0, 1], cfg, step=0, epoch=0, keep=keep)  # the default: in place, weight 0
    assert {r for group in masked for p in group for r in p.rows} == set(range(12))
