"""Tree rollouts: BranchGRPO (Li et al. 2025, "BranchGRPO", Sec. 3.1, branching scheme).

Every leaf of one prompt starts from the same initial noise. At the configured split
steps each node draws one noise per child, so the tree has prod(branch factors) leaves;
between splits a node advances with the step rule (SDE inside the window, ODE outside,
splits always stochastic). Shared prefixes are computed once, and all active nodes of
all trees go through the transformer together (in chunks of ``rollout.batch_size``
rows).

Layout: nodes are stored level-major (all depth-0 roots, then depth 1, ...), and within
a level tree-major, then by *ordinal* (the node's index among its tree's nodes at that
depth). The children of ordinal j at a step with factor b are ordinals j*b ... j*b+b-1,
so parents, siblings and leaf ancestors follow in closed form, and a leaf's ordinal is
its sample index in the group.

Replay is exact: the root noise is the key of sample 0, ``(*root, 0, "init")``, and the
edge into a node at depth t+1 with ordinal j draws ``(*root, j, "sde", t)``. With factor 1
everywhere that is exactly the independent sampler's draw for sample 0 (tested bit for
bit), and any stored root-to-leaf path replays through :func:`rollout.denoise`.

Split-noise scale (``tree.split_noise``): with ``level`` (the default) the step rule's noise
level is multiplied by ``split_noise_scale`` at split steps, so the drift correction and
the log-prob both use the scaled std: the transition stays a proper SDE step and its
log-prob is the density of what was sampled. With ``draw`` only the drawn noise is scaled
and the drift and log-prob keep the unscaled std, as the BranchGRPO reference does
(Fredreic1849/BranchGRPO, ``fastvideo/train_branchgrpo_flux.py: flux_step_with_split``);
its log-prob is then that of N(mean, std^2) while the child was drawn from N(mean,
(scale std)^2). The stored noise, and the noise a sub-tree regeneration redraws from
the keys, is the scaled draw, so both reproduce the children exactly in both modes.

Reference: Fredreic1849/BranchGRPO, ``fastvideo/train_branchgrpo_flux.py``
(``run_tree_sample_step``: the same node layout, children of ordinal j at 2j, 2j + 1 for
factor 2). Deliberate deviation: ``split_noise: level`` by default (above).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.sampling import rng
from diffrl.sampling.rollout import Trajectory, initial_noise
from diffrl.sampling.schedule import check_consistency_grid, sigma_grid
from diffrl.sampling.sde import step
from diffrl.sampling.settings import SamplerSettings
from diffrl.sampling.tree_spec import TreeSpec
from diffrl.sampling.windows import step_kinds


class TreeLayout:
    """What the node layout alone answers (leaves, root-to-leaf paths), shared by a
    :class:`TreeTrajectory` and a :class:`TreePool`, which both have ``parent``, ``depth``,
    ``spec``, ``root_keys`` and ``keys``."""

    @property
    def num_trees(self) -> int:
        return len(self.root_keys)

    @property
    def num_leaves(self) -> int:
        return len(self.keys)

    @property
    def num_steps(self) -> int:
        return self.spec.num_steps

    def leaf_nodes(self) -> torch.Tensor:
        return torch.nonzero(self.depth == self.num_steps).flatten()

    def paths(self, leaves=None) -> torch.Tensor:
        """(B, T+1) node indices of the root-to-leaf path of each leaf (default: all)."""
        nodes = self.leaf_nodes() if leaves is None else self.leaf_nodes()[torch.as_tensor(leaves)]
        cols = [nodes]
        for _ in range(self.num_steps):
            cols.append(self.parent[cols[-1]])
        return torch.stack(cols[::-1], 1)


@dataclass
class TreeTrajectory(TreeLayout):
    """All nodes of a batch of trees (N nodes, L = trees * leaves leaves).

    Per-node edge fields describe the transition *into* the node from its parent (they
    are zero for roots). ``noise`` holds the initial noise for roots and the eps drawn on
    the incoming edge otherwise (zeros on ODE edges).
    """

    latents: torch.Tensor  # (N, *shape) fp32
    means: torch.Tensor  # (N, *shape) mean of the incoming transition
    log_probs: torch.Tensor  # (N,) log-prob of the incoming transition under the rollout policy
    stds: torch.Tensor  # (N,) transition std (0 for ODE edges and roots)
    std_ts: torch.Tensor  # (N,) the step rule's noise scale (for the flow_grpo KL variant)
    noise: torch.Tensor  # (N, *shape)
    parent: torch.Tensor  # (N,) long, -1 for roots
    depth: torch.Tensor  # (N,) long: the node holds x_depth; the incoming edge is step depth - 1
    tree: torch.Tensor  # (N,) long, local tree index
    ordinal: torch.Tensor  # (N,) long, index among the tree's nodes at this depth
    sigmas: torch.Tensor  # (T+1,)
    step_kinds: list[str]  # (T,)
    noise_levels: list[float]  # (T,)
    spec: TreeSpec
    root_keys: list[tuple]  # (P,) key prefix of each tree
    cond_rows: list[int]  # (P,) row of each tree in the caller's conditioning (its first leaf)
    keys: list[tuple]  # (L,) leaf keys, tree-major: (*root, leaf ordinal)
    nfe: int = 0
    images: torch.Tensor | None = None  # (L, ...) decoded leaves, in ``keys`` order

    def path_trajectory(self, leaves=None) -> Trajectory:
        """Root-to-leaf paths as an independent :class:`Trajectory` (shared prefixes
        duplicated): what a replay or a per-sample consumer reads."""
        p = self.paths(leaves)
        child = p[:, 1:]
        idx = torch.arange(self.num_leaves) if leaves is None else torch.as_tensor(leaves)
        return Trajectory(
            latents=self.latents[p],
            means=self.means[child],
            log_probs=self.log_probs[child],
            stds=self.stds[child],
            std_ts=self.std_ts[child],
            sigmas=self.sigmas,
            step_kinds=list(self.step_kinds),
            step_noise=self.noise[child],
            keys=[self.keys[i] for i in idx.tolist()],
            nfe=0,
            images=None if self.images is None else self.images[idx],
            noise_levels=list(self.noise_levels),
        )

    def transition(self, rows, t: int):
        """(x_t, x_next, old log-prob, conditioning rows) of the edges into nodes ``rows``."""
        ix = torch.as_tensor(rows)
        cond_rows = [self.cond_rows[k] for k in self.tree[ix].tolist()]
        return self.latents[self.parent[ix]], self.latents[ix], self.log_probs[ix], cond_rows

    def old_means(self, rows, t: int) -> torch.Tensor:
        """The rollout's transition means of the edges into nodes ``rows``."""
        return self.means[torch.as_tensor(rows)]


@dataclass
class TreePool(TreeLayout):
    """A tree pool as Sol-RL reads it (Sol-RL, "FP4 Explore, BF16 Train", Sec. 3): the
    leaves' images, which selection scores, and the layout and keys from which
    :func:`diffrl.sampling.subtree.regenerate_subtree` picks a sub-tree and redraws its
    noise. No per-node latent, mean or noise: nothing reads a pool's, and each was as
    large as all the nodes' latents."""

    parent: torch.Tensor  # (N,) long, -1 for roots
    depth: torch.Tensor  # (N,) long
    tree: torch.Tensor  # (N,) long, local tree index
    ordinal: torch.Tensor  # (N,) long, index among the tree's nodes at this depth
    sigmas: torch.Tensor  # (T+1,)
    step_kinds: list[str]  # (T,) as explored (the regeneration steps the same way)
    noise_levels: list[float]  # (T,)
    spec: TreeSpec
    root_keys: list[tuple]  # (P,)
    cond_rows: list[int]  # (P,)
    keys: list[tuple]  # (L,) leaf keys
    nfe: int = 0
    images: torch.Tensor | None = None  # (L, ...) decoded leaves; dropped once scored


def root_noise_keys(roots: list[tuple], block: int = 1) -> list[tuple]:
    """The initial-noise key of each tree, ``(*root, 0)`` (its first leaf's); with ``block``
    N > 1, consecutive prompt groups share the first one's in blocks of N, as BranchGRPO's
    ``init_same_noise`` makes the trees one GPU grows in a call share one root noise
    (``fastvideo/train_branchgrpo_flux.py:806-829``: one draw, repeated over the batch).
    A root is (seed, iteration, prompt group)."""
    return [(*r[:-1], r[-1] // block * block, 0) if block > 1 else (*r, 0) for r in roots]


def trees_from_keys(keys, leaves: int) -> tuple[list[tuple], list[int]]:
    """Group per-leaf keys ``(*root, leaf)`` into trees; each tree must list its leaves
    0..leaves-1 contiguously (the sample plan's group-major order)."""
    roots, rows = [], []
    for start in range(0, len(keys), leaves):
        block = keys[start : start + leaves]
        root = tuple(block[0][:-1])
        if (
            len(block) != leaves
            or [tuple(k[:-1]) for k in block] != [root] * leaves
            or [k[-1] for k in block] != list(range(leaves))
        ):
            raise ValueError(
                f"tree rollouts need {leaves} consecutive samples per prompt with indices "
                f"0..{leaves - 1}; got keys {block[:3]}... (is rollout.group_size the tree's leaf count, "
                "and does every process hold whole prompts?)"
            )
        roots.append(root)
        rows.append(start)
    return roots, rows


def velocity_chunks(adapter, transformer, x, sigma, cond, cond_rows, batch_size: int) -> torch.Tensor:
    outs = []
    for s in range(0, x.shape[0], batch_size):
        rows = cond_rows[s : s + batch_size]
        outs.append(
            adapter.velocity(transformer, x[s : s + batch_size], sigma.expand(len(rows)), cond.select(rows))
        )
    return torch.cat(outs)


class TreeGrowth:
    """What every level of a tree rollout shares (model, prompts, schedule, step rule),
    and the per-node tensors recorded level by level in the level-major layout.
    :func:`rollout_tree` grows whole trees with it, and
    :func:`diffrl.sampling.subtree.regenerate_subtree` a pool's sub-tree. ``record=False``
    keeps nothing per node (a Sol-RL pool: only the last level, the leaves, is used)."""

    def __init__(self, adapter, transformer, cond, cond_rows, sigmas, kinds, levels, settings, record=True):
        self.adapter, self.transformer, self.cond, self.cond_rows = adapter, transformer, cond, cond_rows
        self.sigmas, self.kinds, self.levels = sigmas, list(kinds), list(levels)
        self.sigma_1 = float(sigmas[1]) if len(sigmas) > 1 else None
        self.batch_size, self.reduction = settings.batch_size, settings.logprob_reduction
        self.nfe, self.record = 0, record
        self.rows = {k: [] for k in ("latents", "means", "noise", "log_probs", "stds", "std_ts")}

    def start(self, roots: torch.Tensor) -> torch.Tensor:
        """Record the roots (their latent is their initial noise) and return them."""
        zeros = torch.zeros(len(roots), device=roots.device)
        self._record(roots, torch.zeros_like(roots), roots, zeros, zeros, zeros)
        return roots

    def level(self, t: int, x, tree_of, parent_pos, eps, idle_forwards: int = 0) -> torch.Tensor:
        """Step the nodes ``x`` at depth ``t`` (of trees ``tree_of``) into their children:
        each node is evaluated once, and child i continues from node ``parent_pos[i]``
        with the edge noise ``eps[i]``. Returns the children's latents. ``idle_forwards``
        more forwards of one row run and are dropped (FSDP alignment, see
        :func:`diffrl.sampling.subtree.idle_forwards_per_level`); they are not counted."""
        device = x.device
        rows = [self.cond_rows[k] for k in tree_of.tolist()]
        sigma = self.sigmas[t].to(device)
        v = velocity_chunks(self.adapter, self.transformer, x, sigma, self.cond, rows, self.batch_size)
        for _ in range(idle_forwards):
            self.adapter.velocity(self.transformer, x[:1], sigma.expand(1), self.cond.select(rows[:1]))
        self.nfe += x.shape[0]
        res = step(
            self.kinds[t],
            x[parent_pos],
            v[parent_pos],
            self.sigmas[t],
            self.sigmas[t + 1],
            self.levels[t],
            sigma_1=self.sigma_1,
            noise=eps,
            reduction=self.reduction,
        )
        self._record(res.next_latents, res.mean, eps, res.log_prob, res.std, res.std_t)
        return res.next_latents

    def _record(self, *values) -> None:
        if not self.record:
            return
        for rows, value in zip(self.rows.values(), values, strict=True):
            rows.append(value)

    def node_tensors(self) -> dict[str, torch.Tensor]:
        """The recorded per-node tensors, level-major, as :class:`TreeTrajectory` fields."""
        return {k: torch.cat(v) for k, v in self.rows.items()}


@torch.no_grad()
def rollout_tree(
    adapter,
    transformer,
    cond,
    keys,
    cfg,
    iteration: int = 0,
    spec: TreeSpec | None = None,
    keep_steps: bool = True,
) -> TreeTrajectory | TreePool:
    """Grow one tree per prompt group in ``keys`` (``cond`` has one row per key) and decode
    the leaves. ``spec`` defaults to the config's ``tree`` section. ``keep_steps=False``
    (a Sol-RL exploration pool) keeps no per-node tensor and returns a :class:`TreePool`."""
    cfg = SamplerSettings.of(cfg)
    spec = spec or TreeSpec.from_config(cfg)
    roots, cond_rows = trees_from_keys(list(keys), spec.leaves)
    n_steps, shape = spec.num_steps, adapter.latent_shape()
    sigmas = sigma_grid(adapter, n_steps, cfg.sampling.sigma_shift)
    kinds = step_kinds(cfg.sampling, n_steps, iteration, always_sde=spec.split_steps, seed=cfg.seed)
    check_consistency_grid(sigmas, kinds)
    levels = spec.noise_levels(cfg.sampling.noise_level)
    draw_scales = spec.draw_scales()
    lay = spec.layout(len(roots))

    grow = TreeGrowth(adapter, transformer, cond, cond_rows, sigmas, kinds, levels, cfg, keep_steps)
    x = grow.start(
        rng.to_device(initial_noise(shape, root_noise_keys(roots, spec.root_block)), adapter.device)
    )
    for t, kind in enumerate(kinds):
        here = lay["depth"] == t
        tree_of, ord_of = lay["tree"][here], lay["ordinal"][here]
        # a node of ordinal j at a split of factor b has children of ordinals j*b ... j*b+b-1
        b = spec.factors[t]
        parent_pos = torch.arange(len(ord_of)).repeat_interleave(b)
        child_ord = ord_of.repeat_interleave(b) * b + torch.arange(b).repeat(len(ord_of))
        eps = edge_noise(shape, roots, tree_of[parent_pos], child_ord, kind, t, draw_scales[t])
        x = grow.level(t, x, tree_of, parent_pos, rng.to_device(eps, x.device))
    layout = dict(
        parent=lay["parent"],
        depth=lay["depth"],
        tree=lay["tree"],
        ordinal=lay["ordinal"],
        sigmas=sigmas.cpu(),
        step_kinds=kinds,
        noise_levels=levels,
        spec=spec,
        root_keys=roots,
        cond_rows=cond_rows,
        keys=[(*r, j) for r in roots for j in range(spec.leaves)],
        nfe=grow.nfe,
    )
    if not keep_steps:  # the last level is the leaves, in ``keys`` order
        return TreePool(**layout, images=decode_chunks(adapter, x, cfg.batch_size))
    traj = TreeTrajectory(**grow.node_tensors(), **layout)
    traj.images = decode_leaves(adapter, traj, cfg.batch_size)
    return traj


def edge_noise(shape, roots, child_tree, child_ord, kind: str, t: int, scale: float) -> torch.Tensor:
    """The noise of the edges into the children at step ``t``: keyed by (root, ordinal,
    "sde", t), times the split's draw scale; zeros on an ODE step. Each edge's draw
    depends on its key alone, so any subset of a level redraws bit for bit."""
    if kind == "ode":
        return torch.zeros((len(child_ord), *shape))
    keys = [(*roots[k], j) for k, j in zip(child_tree.tolist(), child_ord.tolist())]
    return rng.randn_batch(shape, keys, "sde", t) * scale


def decode_leaves(adapter, traj: TreeTrajectory, batch_size: int) -> torch.Tensor:
    """The decoded images of ``traj``'s leaves, ``batch_size`` at a time."""
    return decode_chunks(adapter, traj.latents[traj.leaf_nodes()], batch_size)


def decode_chunks(adapter, leaves: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The decoded images of the latents ``leaves``, ``batch_size`` at a time, written into
    one tensor allocated at the first chunk (a list of chunks joined at the end would hold
    every image twice for a moment: a pool's images are its largest buffer)."""
    out = None
    for s in range(0, len(leaves), batch_size):
        images = adapter.decode(leaves[s : s + batch_size]).float()
        if out is None:
            out = images.new_empty((len(leaves), *images.shape[1:]))
        out[s : s + len(images)] = images
    return out
