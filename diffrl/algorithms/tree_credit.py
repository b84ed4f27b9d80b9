"""Credit assignment on trees: BranchGRPO (Li et al. 2025, Sec. 3.2-3.3).

* **Reward fusion** (Sec. 3.2): leaves keep their reward; an internal node gets the
  mean of its leaves (``mean``), or the softmax(child-edge log-prob / T)-weighted mean
  of its children's fused rewards (``prob_weighted``), applied bottom-up. Siblings share
  their transition mean and std, so their log-prob difference is -(|eps_a|^2 -
  |eps_b|^2) / 2 (divided by the element count under the ``mean`` reduction): the
  weights favour the child whose noise draw was smaller, and are close to uniform under
  ``mean``. That is the reference's definition; ``sum`` is refused by the config check.
* **Depth-wise advantages** (Sec. 3.2): fused rewards are normalised among the nodes of
  one tree at one depth, with any core estimator (``group``, ``median``,
  ``decoupled``, ...): the (tree, depth) pair is the group. The edge into a node trains
  with that node's advantage. Stds follow ``advantage.std`` / ``advantage.eps``: the
  reference's ``compute_hierarchical_advantages_by_depth`` is ``std: sample`` with
  ``eps: 1e-8`` (it also zeroes a group whose std is below 1e-6).
* **Pruning** (Sec. 3.3) removes edges from backprop only; the rollout, the rewards and
  the fused values are computed from the full tree.

  - *Width*: after the last split each node has one leaf below it; the edges after the
    last split (steps > last split) are kept only for the best + worst leaves of each
    tree (``best_worst``) or for the best of each sibling set of the last split
    (``best_per_branch``). These are our modes. The reference's own two modes
    (Fredreic1849/BranchGRPO, ``fastvideo/train_branchgrpo_flux.py``, width pruning in
    ``train_one_step_tree``) are offered under their own names and keep other edges:
    ``chain_prefix`` (its mode 1) keeps the first max(1, int(L * fraction)) of the L
    post-split edges of every root-to-leaf chain whatever the rewards (its groups are
    single chains, whose edges all tie in advantage, and a stable sort keeps the
    earliest); ``batch_best_worst`` (its mode 2) ranks every post-split edge of every
    tree on this process by advantage (ties in tree, leaf, step order) and keeps the
    best k // 2 and the worst k - k // 2, k = max(2, int(n * fraction)), so whole chains
    of the batch's extremes, unevenly per tree, and a chain cut at the boundary keeps
    its earliest (best side) or latest (worst side) steps.
  - *Depth*: edges at the listed denoising steps are skipped; with
    ``depth_pruning_slide_every = k`` the set moves one step earlier every k iterations,
    down to ``depth_pruning_stop``. (The reference counts the child's depth, step + 1.)

Edges that can never carry signal are not trained either: ODE edges (no ratio) and the
trunk above the first split, where a tree has one node per depth (its depth-wise
advantage is always 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.algorithms.advantages import compute_advantages


def fuse_rewards(
    tree, leaf_values: torch.Tensor, mode: str = "mean", temperature: float = 1.0
) -> torch.Tensor:
    """Node values (N, K) from leaf values (L, K) in leaf order, bottom-up along ``parent``
    (so an irregular tree, such as a Sol-RL regenerated sub-tree, works too)."""
    if mode not in ("mean", "prob_weighted"):
        raise ValueError(f"unknown tree.reward_fusion '{mode}'; valid: mean, prob_weighted")
    n, k = tree.depth.numel(), leaf_values.shape[1]
    parent, depth = tree.parent.cpu(), tree.depth.cpu()
    leaf = depth == tree.num_steps
    total = torch.zeros(n, k, dtype=torch.float64)
    total[leaf] = leaf_values.double().cpu()
    count = leaf.double()  # leaves below each node (mean fusion)
    for d in range(tree.num_steps - 1, -1, -1):
        child = torch.nonzero(depth == d + 1).flatten()
        par = parent[child]
        if mode == "mean":
            total.index_add_(0, par, total[child])
            count.index_add_(0, par, count[child])
        else:
            weights = _sibling_softmax(tree.log_probs.cpu().double()[child] / temperature, par, n)
            total.index_add_(0, par, weights.unsqueeze(1) * total[child])
    return total / count.unsqueeze(1) if mode == "mean" else total


def _sibling_softmax(logits: torch.Tensor, parent: torch.Tensor, n: int) -> torch.Tensor:
    """Softmax of ``logits`` within each set of children of one parent."""
    peak = torch.full((n,), float("-inf"), dtype=logits.dtype).scatter_reduce(0, parent, logits, "amax")
    e = torch.exp(logits - peak[parent])
    return e / torch.zeros(n, dtype=logits.dtype).index_add_(0, parent, e)[parent]


def multi_node(groups: torch.Tensor) -> torch.Tensor:
    """Bool per entry: its (tree, depth) group holds more than one node. A single-node
    depth (the trunk before the first split, or a sub-tree's unbranched stretch) always
    gets a zero depth-wise advantage."""
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    return counts[inverse] > 1


def depth_pruned_steps(tree_cfg, iteration: int) -> set[int]:
    """The denoising steps whose edges skip backprop at ``iteration``."""
    steps = sorted(tree_cfg.depth_pruning)
    if not steps:
        return set()
    shift = 0
    if tree_cfg.depth_pruning_slide_every > 0:
        shift = min(
            iteration // tree_cfg.depth_pruning_slide_every, max(0, steps[0] - tree_cfg.depth_pruning_stop)
        )
    return {s - shift for s in steps}


def width_kept_leaves(tree, leaf_rewards: torch.Tensor, mode: str, fraction: float) -> torch.Tensor:
    """(L,) bool: leaves whose post-last-split edges are trained."""
    n = tree.num_leaves
    if mode == "none" or tree.spec.last_split < 0:
        return torch.ones(n, dtype=torch.bool)
    if mode == "best_worst":
        size = tree.spec.leaves
        keep = max(2, int(size * fraction))
        best, worst = keep // 2, keep - keep // 2
        groups = leaf_rewards.reshape(-1, size)
    elif mode == "best_per_branch":
        size = tree.spec.factors[tree.spec.last_split]
        best, worst = max(1, int(size * fraction)), 0
        groups = leaf_rewards.reshape(-1, size)
    else:
        raise ValueError(f"unknown tree.width_pruning '{mode}'; valid: {', '.join(WIDTH_MODES)}")
    # stable sort by reward, ties by leaf order, so the choice is deterministic
    order = torch.sort(groups.double(), dim=1, descending=True, stable=True).indices
    chosen = torch.zeros_like(groups, dtype=torch.bool)
    rows = torch.arange(groups.shape[0]).unsqueeze(1)
    chosen[rows, order[:, :best]] = True
    if worst:
        chosen[rows, order[:, size - worst :]] = True
    return chosen.flatten()


WIDTH_MODES = ("none", "best_worst", "best_per_branch", "chain_prefix", "batch_best_worst")


def _chain_prefix(candidates: torch.Tensor, chain: torch.Tensor, step_of: torch.Tensor, fraction: float):
    """BranchGRPO mode 1: the first max(1, int(L * fraction)) candidate edges of each chain."""
    kept = torch.zeros_like(candidates)
    for c in torch.unique(chain[candidates]).tolist():
        idx = torch.nonzero(candidates & (chain == c)).flatten()
        idx = idx[torch.argsort(step_of[idx], stable=True)]
        kept[idx[: max(1, int(len(idx) * fraction))]] = True
    return kept


def _batch_best_worst(
    candidates: torch.Tensor,
    chain: torch.Tensor,
    step_of: torch.Tensor,
    advantages: torch.Tensor,
    fraction: float,
):
    """BranchGRPO mode 2: rank every candidate edge of the batch by advantage (ties in
    chain, then step order, as the reference's depth-first list) and keep both ends."""
    idx = torch.nonzero(candidates).flatten()
    dfs = idx[torch.argsort(chain[idx] * (int(step_of.max()) + 1) + step_of[idx], stable=True)]
    ranked = dfs[torch.argsort(-advantages[dfs].double(), stable=True)]
    k = max(2, int(len(ranked) * fraction))
    kept = torch.zeros_like(candidates)
    kept[ranked[: k // 2]] = True
    kept[ranked[len(ranked) - (k - k // 2) :]] = True
    return kept


def trained_edges(
    tree, tree_cfg, iteration: int, leaf_rewards: torch.Tensor, advantages: torch.Tensor | None = None
) -> torch.Tensor:
    """(N,) bool: nodes whose incoming edge is backpropagated this iteration.
    ``advantages`` (N,), the depth-wise advantage of each node, is needed by
    ``batch_best_worst`` only."""
    spec = tree.spec
    step_of = tree.depth - 1
    stochastic = torch.tensor([k != "ode" for k in tree.step_kinds] + [False])[step_of.clamp(min=0)]
    groups = tree.tree.cpu() * (tree.num_steps + 1) + tree.depth.cpu()
    mask = (tree.depth >= 1) & stochastic & (tree.stds.cpu() > 0) & multi_node(groups)
    pruned = depth_pruned_steps(tree_cfg, iteration)
    if pruned:
        mask &= ~torch.isin(step_of, torch.tensor(sorted(pruned)))
    mode = tree_cfg.width_pruning
    if mode == "none" or spec.last_split < 0:
        return mask
    after = step_of > spec.last_split
    # after the last split a node's ordinal is its leaf's ordinal: one chain per leaf
    leaf_of = torch.where(after, tree.tree * spec.leaves + tree.ordinal, torch.zeros_like(tree.ordinal)).cpu()
    if mode == "chain_prefix":
        return mask & (
            ~after | _chain_prefix(mask & after, leaf_of, step_of.cpu(), tree_cfg.width_keep_fraction)
        )
    if mode == "batch_best_worst":
        if advantages is None:
            raise ValueError("tree.width_pruning batch_best_worst ranks edges by advantage: pass advantages")
        kept = _batch_best_worst(
            mask & after, leaf_of, step_of.cpu(), advantages.cpu(), tree_cfg.width_keep_fraction
        )
        return mask & (~after | kept)
    kept = width_kept_leaves(tree, leaf_rewards, mode, tree_cfg.width_keep_fraction)
    return mask & (~after | kept[leaf_of])


def trained_edge_counts(spec, kinds: list[str], tree_cfg, iteration: int = 0) -> list[int]:
    """Closed form of the trained edges of one tree per step (the run plan uses it; a test
    checks it against :func:`trained_edges`). ``batch_best_worst`` depends on the rewards
    of the whole batch; its count is the even share, as if whole chains were kept."""
    pruned = depth_pruned_steps(tree_cfg, iteration)
    mode, fraction = tree_cfg.width_pruning, tree_cfg.width_keep_fraction
    width = mode != "none" and spec.last_split >= 0
    live = [
        t for t, kind in enumerate(kinds) if kind != "ode" and spec.nodes_at(t + 1) > 1 and t not in pruned
    ]
    post = [t for t in live if t > spec.last_split]
    if mode in ("best_worst", "batch_best_worst"):
        kept = max(2, int(spec.leaves * fraction))
    elif mode == "best_per_branch":
        b = spec.factors[spec.last_split]
        kept = max(1, int(b * fraction)) * (spec.leaves // b)
    prefix = set(post[: max(1, int(len(post) * fraction))])  # chain_prefix: the same steps in every chain
    counts = []
    for t in range(len(kinds)):
        if t not in live:
            counts.append(0)
        elif not width or t <= spec.last_split:
            counts.append(spec.nodes_at(t + 1))
        elif mode == "chain_prefix":
            counts.append(spec.leaves if t in prefix else 0)
        else:
            counts.append(kept)
    return counts


@dataclass
class TreeCredit:
    """Per-node training inputs for the edge into each node."""

    advantages: torch.Tensor  # (N,) depth-wise advantage
    keep: torch.Tensor  # (N,) bool: not filtered for zero variance (masked, still forwarded)
    train: torch.Tensor  # (N,) bool: edge is forwarded and backpropagated
    node_rewards: torch.Tensor  # (N,) fused combined reward
    filtered_fraction: float
    dropped_groups: int = 0  # (tree, depth) groups left out for a non-finite reward


def tree_credit(
    tree, leaf_total, leaf_components, cfg, iteration: int, weights=None, gather=None, rank: int = 0
) -> TreeCredit:
    """Fuse rewards, normalise per (tree, depth) with the configured estimator, prune.

    ``gather`` concatenates a per-process tensor over processes (so that ``decoupled``'s
    batch normalisation sees every tree); this process's block is ``rank``.
    """
    tcfg, acfg = cfg.tree, cfg.advantage
    values = torch.cat([leaf_total.reshape(-1, 1), leaf_components.reshape(len(leaf_total), -1)], 1).cpu()
    fused = fuse_rewards(tree, values, tcfg.reward_fusion, tcfg.fusion_temperature)
    n = fused.shape[0]
    groups = (tree.tree + rank * tree.num_trees) * (tree.num_steps + 1) + tree.depth
    owner = torch.full((n,), rank)
    if gather is not None:  # blocks may differ in length (sub-trees): find ours by owner
        fused, groups, owner = gather(fused), gather(groups), gather(owner)
    # a non-finite leaf reward makes every ancestor's fused value non-finite, so
    # compute_advantages drops each (tree, depth) group on its path: the whole tree.
    # roots have no incoming edge, and single-node depths (the trunk) always get 0: leave
    # both out, or they would pull down the batch std of decoupled / global estimators
    informative = multi_node(groups)
    adv = compute_advantages(
        fused[informative, 0],
        groups[informative],
        acfg.estimator,
        acfg.eps,
        acfg.filter_zero_std,
        fused[informative, 1:],
        weights,
        acfg.std,
    )
    full_adv = torch.zeros(len(groups))
    full_keep = torch.zeros(len(groups), dtype=torch.bool)
    full_adv[informative], full_keep[informative] = adv.values, adv.keep
    sl = owner.cpu() == rank
    train = trained_edges(tree, tcfg, iteration, leaf_total.cpu(), full_adv[sl])
    filtered = _zero_variance_share(fused[:, 0], groups)
    return TreeCredit(full_adv[sl], full_keep[sl], train, fused[sl, 0].float(), filtered, adv.dropped_groups)


def _zero_variance_share(values: torch.Tensor, groups: torch.Tensor) -> float:
    """Share of (tree, depth) groups with several nodes whose fused rewards are all equal
    (single-node depths are structural, not filtered)."""
    multi = multi_node(groups)
    ids = torch.unique(groups[multi])
    if len(ids) == 0:
        return 0.0
    # a group is flat when its largest and smallest value agree: one host read for all groups
    index = torch.searchsorted(ids, groups[multi])
    v = values[multi] if values.is_floating_point() else values[multi].double()
    high = torch.full((len(ids),), -torch.inf, dtype=v.dtype, device=v.device).scatter_reduce(
        0, index, v, "amax"
    )
    low = torch.full((len(ids),), torch.inf, dtype=v.dtype, device=v.device).scatter_reduce(
        0, index, v, "amin"
    )
    return (high == low).float().mean().item()
