"""Regenerate a sub-tree of a tree pool (Sol-RL stage 2 on a BranchGRPO pool).

The selected leaves of a tree and all their ancestors form a sub-tree. It is
regenerated level by level with the policy: each kept node is evaluated once (shared
prefixes are not recomputed per leaf), and every edge replays the noise the pool drew
for it, so with the same weights the sub-tree reproduces the pool's nodes.

The result is a :class:`TreeTrajectory` over the kept nodes only, in the pool's
level-major order, with the pool's ``depth``/``tree``/``ordinal`` and parents remapped.
Its shape is irregular (a parent may keep one child or several), so consumers read the
structure from ``parent``/``depth``, not from the pool's ``spec`` closed forms.
"""

from __future__ import annotations

import torch

from diffrl.sampling.sde import step
from diffrl.sampling.settings import SamplerSettings
from diffrl.sampling.tree import TreeTrajectory, decode_leaves, velocity_chunks


def subtree_nodes(tree: TreeTrajectory, leaves) -> torch.Tensor:
    """Sorted node indices of the union of the root-to-leaf paths of ``leaves`` (leaf
    positions in ``tree.keys`` order)."""
    return torch.unique(tree.paths(torch.as_tensor(leaves)).flatten())


@torch.no_grad()
def regenerate_subtree(adapter, transformer, cond, pool: TreeTrajectory, leaves, cfg) -> TreeTrajectory:
    """Re-run the sub-tree of ``leaves`` through ``transformer`` with the pool's noise.
    ``cond`` is the conditioning the pool was grown with (rows ``pool.cond_rows``)."""
    device = adapter.device
    leaves = torch.sort(torch.as_tensor(leaves)).values
    nodes = subtree_nodes(pool, leaves)
    # pool node index -> position in the sub-tree (-1: not kept), to remap parents
    remap = torch.full((pool.depth.numel(),), -1, dtype=torch.long)
    remap[nodes] = torch.arange(len(nodes))
    depth, tree = pool.depth[nodes], pool.tree[nodes]
    sigmas, sigma_1 = pool.sigmas, float(pool.sigmas[1]) if pool.num_steps > 0 else None
    cfg = SamplerSettings.of(cfg)
    reduction = cfg.logprob_reduction

    n, shape = len(nodes), pool.latents.shape[1:]
    latents = torch.zeros((n, *shape), device=device)
    means = torch.zeros_like(latents)
    log_probs, stds, std_ts = (torch.zeros(n, device=device) for _ in range(3))
    roots = depth == 0
    latents[roots] = pool.noise[nodes[roots]].to(device)
    nfe = 0
    for t, kind in enumerate(pool.step_kinds):
        here = torch.nonzero(depth == t).flatten()
        rows = [pool.cond_rows[k] for k in tree[here].tolist()]
        v = velocity_chunks(
            adapter, transformer, latents[here], sigmas[t].to(device), cond, rows, cfg.batch_size
        )
        nfe += len(here)
        children = torch.nonzero(depth == t + 1).flatten()
        # position of each child's parent within ``here`` (both sorted, so searchsorted):
        # a parent is evaluated once and its velocity shared by its kept children
        parent_pos = torch.searchsorted(here, remap[pool.parent[nodes[children]]])
        # the pool's own draw for each edge (scaled at splits in draw mode): with the same
        # weights the regenerated child equals the pool's; with the BF16 policy it is the
        # same noise through a better model, which is what Sol-RL regenerates
        eps = pool.noise[nodes[children]].to(device)
        res = step(
            kind,
            latents[here][parent_pos],
            v[parent_pos],
            sigmas[t],
            sigmas[t + 1],
            pool.noise_levels[t],
            sigma_1=sigma_1,
            noise=eps,
            reduction=reduction,
        )
        latents[children], means[children] = res.next_latents, res.mean
        log_probs[children], stds[children], std_ts[children] = res.log_prob, res.std, res.std_t
    parent = torch.where(roots, torch.full_like(depth, -1), remap[pool.parent[nodes].clamp(min=0)])
    traj = TreeTrajectory(
        latents=latents,
        means=means,
        log_probs=log_probs,
        stds=stds,
        std_ts=std_ts,
        noise=pool.noise[nodes].clone(),
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
        nfe=nfe,
    )
    traj.images = decode_leaves(adapter, traj, cfg.batch_size)
    return traj
