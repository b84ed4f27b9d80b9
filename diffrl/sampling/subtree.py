"""Regenerate a sub-tree of a tree pool (Sol-RL stage 2 on a BranchGRPO pool).

The selected leaves of a tree and all their ancestors form a sub-tree. It is
regenerated level by level with the policy: each kept node is evaluated once (shared
prefixes are not recomputed per leaf), and every edge replays the noise the pool drew
for it, so with the same weights the sub-tree reproduces the pool's nodes.

The pool is read for its layout and keys only (a :class:`TreePool` keeps nothing else;
a whole :class:`TreeTrajectory` works too): each kept edge's noise is redrawn from its
key (root, ordinal, step), bit for bit what the pool drew, so the pool need not store a
latent-sized noise per node (Sol-RL, "FP4 Explore, BF16 Train", Sec. 3: the BF16 policy
regenerates the selected samples from the exploration's noise).

The result is a :class:`TreeTrajectory` over the kept nodes only, in the pool's
level-major order, with the pool's ``depth``/``tree``/``ordinal`` and parents remapped.
Its shape is irregular (a parent may keep one child or several), so consumers read the
structure from ``parent``/``depth``, not from the pool's ``spec`` closed forms.
"""

from __future__ import annotations

import math

import torch

from diffrl.sampling import rng
from diffrl.sampling.rollout import initial_noise
from diffrl.sampling.settings import SamplerSettings
from diffrl.sampling.tree import (
    TreeGrowth,
    TreeLayout,
    TreeTrajectory,
    decode_leaves,
    edge_noise,
    root_noise_keys,
)


def subtree_nodes(tree: TreeLayout, leaves) -> torch.Tensor:
    """Sorted node indices of the union of the root-to-leaf paths of ``leaves`` (leaf
    positions in ``tree.keys`` order)."""
    return torch.unique(tree.paths(torch.as_tensor(leaves)).flatten())


def idle_forwards_per_level(depth, num_steps: int, batch_size: int, align_forwards) -> list[int]:
    """Forwards each level must add so that every process runs the same number.

    A sub-tree's level sizes depend on this process's selection, so its chunked forwards
    differ in number between processes. Under FSDP every forward gathers weights (a
    collective), and unequal counts would hang; ``align_forwards`` maps this process's
    per-level counts to the common ones (their maximum), and the difference is run on a
    dummy row whose output is dropped. Without it, nothing is added."""
    local = [math.ceil(int((depth == t).sum()) / batch_size) for t in range(num_steps)]
    if align_forwards is None:
        return [0] * num_steps
    return [common - mine for common, mine in zip(align_forwards(local), local, strict=True)]


@torch.no_grad()
def regenerate_subtree(
    adapter, transformer, cond, pool: TreeLayout, leaves, cfg, align_forwards=None
) -> TreeTrajectory:
    """Re-run the sub-tree of ``leaves`` through ``transformer`` with the pool's noise,
    redrawn from the keys. ``pool`` is a :class:`TreePool` or a whole
    :class:`TreeTrajectory`; ``cond`` is the conditioning it was grown with (rows
    ``pool.cond_rows``); ``align_forwards`` (FSDP) is described in
    :func:`idle_forwards_per_level`."""
    cfg = SamplerSettings.of(cfg)
    leaves = torch.sort(torch.as_tensor(leaves)).values
    nodes = subtree_nodes(pool, leaves)
    # pool node index -> position in the sub-tree (-1: not kept), to remap parents
    remap = torch.full((pool.depth.numel(),), -1, dtype=torch.long)
    remap[nodes] = torch.arange(len(nodes))
    depth, tree = pool.depth[nodes], pool.tree[nodes]
    roots = depth == 0

    grow = TreeGrowth(
        adapter, transformer, cond, pool.cond_rows, pool.sigmas, pool.step_kinds, pool.noise_levels, cfg
    )
    idle = idle_forwards_per_level(depth, pool.num_steps, cfg.batch_size, align_forwards)
    shape, scales = adapter.latent_shape(), pool.spec.draw_scales()
    root_keys = root_noise_keys([pool.root_keys[k] for k in tree[roots].tolist()], pool.spec.root_block)
    x = grow.start(rng.to_device(initial_noise(shape, root_keys), adapter.device))
    for t in range(pool.num_steps):
        here = torch.nonzero(depth == t).flatten()
        children = torch.nonzero(depth == t + 1).flatten()
        # position of each child's parent within ``here`` (both sorted, so searchsorted):
        # a parent is evaluated once and its velocity shared by its kept children
        parent_pos = torch.searchsorted(here, remap[pool.parent[nodes[children]]])
        # the pool's own draw for each edge, redrawn from its key (scaled at splits in draw
        # mode): with the same weights the regenerated child equals the pool's; with the
        # BF16 policy it is the same noise through a better model, which Sol-RL regenerates
        kind, ordinal = pool.step_kinds[t], pool.ordinal[nodes[children]]
        eps = edge_noise(shape, pool.root_keys, tree[children], ordinal, kind, t, scales[t])
        eps = rng.to_device(eps, x.device)
        x = grow.level(t, x, tree[here], parent_pos, eps, idle_forwards=idle[t])
    parent = torch.where(roots, torch.full_like(depth, -1), remap[pool.parent[nodes].clamp(min=0)])
    traj = TreeTrajectory(
        **grow.node_tensors(),
        parent=parent,
        depth=depth,
        tree=tree,
        ordinal=pool.ordinal[nodes],
        sigmas=pool.sigmas,
        step_kinds=list(pool.step_kinds),
        noise_levels=list(pool.noise_levels),
        spec=pool.spec,
        root_keys=list(pool.root_keys),
        cond_rows=list(pool.cond_rows),
        keys=[pool.keys[i] for i in leaves.tolist()],
        nfe=grow.nfe,
    )
    traj.images = decode_leaves(adapter, traj, cfg.batch_size)
    return traj
