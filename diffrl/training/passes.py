"""How an iteration's transitions are split into forward passes and optimizer steps.

A :class:`Pass` is one forward of the objective: rows of one trajectory at one
denoising step (a scalar sigma). An optimizer step accumulates a list of passes; each
pass's mean loss is weighted by ``share`` so that the step averages over its
transitions.

* Independent trajectories (:func:`sample_major`): the process's samples are shuffled
  (keyed by seed, iteration and epoch), cut into micro-batches, and each micro-batch is
  trained on a keyed subset of max(1, int(fraction * n)) of its n trainable steps
  (``objective.timestep_fraction``), as flow_grpo and DiffusionNFT do (rounded down).
* Trees (:func:`edge_major`): the trained edges of each step are shuffled and spread
  evenly over the optimizer steps (a step with fewer edges than optimizer steps fills
  them round-robin from a step-dependent offset; an optimizer step left with no edge at
  all is dropped). The number of passes depends only on per-step edge counts, which are
  the same on every process (DDP needs the same forwards everywhere).
  ``timestep_fraction`` keeps that share of each step's edges (rounded up, so a step
  with one edge keeps it). Masked edges (zero-
  variance groups, median pivots) count as zero losses. With ``tree.loss_weighting:
  edge`` every edge of an optimizer step weighs the same (BranchGRPO), and wide late
  steps dominate; with ``depth`` each step present in the optimizer step gets an equal
  part, as each step does for independent rollouts. (Normalising by kept edges instead
  let the few kept edges of a mostly masked early step carry a whole step's weight, and
  ShapeWorld training fell apart: docs/notes/2026-11-trees-and-solrl-history.md.)

Both give the same number of optimizer steps per epoch for the same number of samples
(leaves): ceil(ceil(samples / micro_batch_size) / gradient_accumulation).

The velocity anchor (``objective.anchor_coef``, :mod:`diffrl.algorithms.anchor`) adds
passes on the untrained steps: per micro-batch for independent trajectories
(:func:`sample_major`), and for trees a keyed share of the nodes at each ODE step, spread
over the optimizer steps like edges (:func:`add_tree_anchors`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffrl.sampling import rng


@dataclass(frozen=True)
class PassSettings:
    """What the pass plans read from the configuration, and nothing else."""

    seed: int
    micro_batch_size: int  # train.micro_batch_size: rows per forward
    gradient_accumulation: int  # train.gradient_accumulation: micro-batches per optimizer step
    timestep_fraction: float  # objective.timestep_fraction
    anchor_fraction: float  # objective.anchor_fraction
    loss_weighting: str  # tree.loss_weighting: "edge" or "depth"
    timestep_selection: str = "random"  # objective.timestep_selection: "random" or "first"
    edges_per_step: int = 0  # tree.edges_per_step: 0, the leaves decide the optimizer steps
    shuffle: bool = True  # train.shuffle_samples: false trains samples in rollout order

    @classmethod
    def of(cls, cfg) -> PassSettings:
        """``cfg`` narrowed to the pass settings (a PassSettings passes through)."""
        if isinstance(cfg, cls):
            return cfg
        t, o = cfg.train, cfg.objective
        return cls(
            cfg.seed,
            t.micro_batch_size,
            t.gradient_accumulation,
            o.timestep_fraction,
            o.anchor_fraction,
            cfg.tree.loss_weighting,
            o.timestep_selection,
            cfg.tree.edges_per_step,
            t.shuffle_samples,
        )


@dataclass
class Pass:
    """One forward of the objective.

    ``counted`` is the one per-row mask the loss sees: False for a row whose loss is
    masked (``Credit.keep`` is False: a zero-variance group, a median pivot, a dropped
    group) and for a DDP padding row. Both are forwarded so that every process runs the
    same passes; they differ only in the share's denominator, which counts masked rows
    (a masked edge weighs as a zero loss) but never padding."""

    rows: list[int]  # sample indices (independent) or node indices (tree)
    t: int  # denoising step
    share: tuple[int, int]  # (numerator, denominator): weight of the pass's mean loss in its optimizer step
    counted: list[bool] | None = None  # per row: does its loss count? None: every row counts
    anchor: bool = False  # a velocity-anchor pass on an untrained step (diffrl.algorithms.anchor)

    def row_weights(self) -> torch.Tensor:
        """(len(rows),) float: 1 where the row's loss counts, 0 where it is masked or padding."""
        if self.counted is None:
            return torch.ones(len(self.rows))
        return torch.tensor(self.counted, dtype=torch.float32)


def _counted(keep: torch.Tensor | None, rows) -> list[bool] | None:
    if keep is None:
        return None
    flags = keep[torch.as_tensor(rows, dtype=torch.long)].tolist()
    return None if all(flags) else flags


def optimizer_steps_per_epoch(samples: int, cfg) -> int:
    s = PassSettings.of(cfg)
    return math.ceil(math.ceil(samples / s.micro_batch_size) / s.gradient_accumulation)


def trained_step_count(fraction: float, n: int) -> int:
    """Steps trained per sample out of ``n``: max(1, int(fraction * n)), rounded down as
    flow_grpo (``scripts/train_sd3.py``: ``int(num_steps * timestep_fraction)``) and
    DiffusionNFT do, so fraction 0.99 of 10 steps trains 9."""
    return max(1, int(fraction * n))


def train_timesteps(
    trainable: list[int], fraction: float, *key, round_up: bool = False, first: bool = False
) -> list[int]:
    """A keyed random subset of :func:`trained_step_count` trainable steps (ceil(fraction
    * len) with ``round_up``), in time order; with ``first``, the first ones, as
    flow_grpo's ``scripts/train_sd3.py`` trains steps ``range(num_train_timesteps)`` (0.99
    of 10 steps: steps 0-8, never the last, whose narrow Gaussian makes the log-prob the
    least stable)."""
    k = (
        max(1, math.ceil(fraction * len(trainable)))
        if round_up
        else trained_step_count(fraction, len(trainable))
    )
    if k >= len(trainable):
        return list(trainable)
    if first:
        return list(trainable[:k])
    perm = torch.randperm(len(trainable), generator=rng.generator(*key))[:k]
    return sorted(trainable[i] for i in perm.tolist())


def _shuffled(n: int, groups: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """A keyed permutation of ``n`` samples; with ``groups``, of the groups, members kept
    together in their order."""
    if groups is None:
        return torch.randperm(n, generator=generator).tolist()
    distinct = torch.unique(groups)
    return [
        i
        for g in distinct[torch.randperm(len(distinct), generator=generator)].tolist()
        for i in torch.nonzero(groups == g).flatten().tolist()
    ]


def _sample_order(n: int, groups, s: PassSettings, step: int, epoch: int) -> list[int]:
    """The keyed shuffle of an epoch's samples, or with ``train.shuffle_samples`` false the
    rollout order (DanceGRPO's ``train_grpo_flux.py`` trains each GPU's samples in order)."""
    if not s.shuffle:
        return list(range(n))
    return _shuffled(n, groups, rng.generator(s.seed, "shuffle", step, epoch))


def sample_major(
    n: int,
    trainable: list[int],
    cfg,
    step: int,
    epoch: int,
    anchored: list[int] = (),
    keep: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    refill: torch.Tensor | None = None,
) -> list[list[Pass]]:
    """Micro-batches of samples, each trained on a keyed subset of ``trainable`` steps.
    With ``anchored`` steps, each micro-batch also gets anchor passes on a keyed subset
    of them (``objective.anchor_fraction``); policy and anchor passes are normalised
    separately, so anchoring never rescales the policy loss. ``keep`` (per sample) marks
    the samples whose loss counts; the others are forwarded with weight 0. With
    ``groups`` (per sample), whole groups are shuffled instead of samples, so a
    micro-batch of a multiple of the group size holds whole groups (none: ``_sample_order``). With ``refill``
    (``advantage.drop_zero``) the samples ``keep`` leaves out are not forwarded at all:
    :func:`dropped_layout`."""
    s = PassSettings.of(cfg)
    mb, accum = s.micro_batch_size, s.gradient_accumulation
    first = s.timestep_selection == "first"
    order = _sample_order(n, groups, s, step, epoch)
    if refill is None:
        batches = [order[i : i + mb] for i in range(0, n, mb)]
        counted = [_counted(keep, idx) for idx in batches]
    else:
        batches, counted = dropped_layout(order, keep, refill, math.ceil(n / mb), s.seed, step)
    anchored = list(anchored)
    groups = []
    for start in range(0, len(batches), accum):
        chunk = list(enumerate(batches[start : start + accum]))
        pairs = [
            (idx, t, counted[start + j])
            for j, idx in chunk
            for t in train_timesteps(
                trainable, s.timestep_fraction, s.seed, "t", step, epoch, start, j, first=first
            )
        ]
        passes = [Pass(idx, t, (1, len(pairs)), flags) for idx, t, flags in pairs]
        if anchored:
            extra = [
                (idx, t, counted[start + j])
                for j, idx in chunk
                for t in train_timesteps(
                    anchored,
                    s.anchor_fraction,
                    s.seed,
                    "anchor",
                    step,
                    epoch,
                    start,
                    j,
                    round_up=True,
                )
            ]
            passes += [Pass(idx, t, (1, len(extra)), flags, anchor=True) for idx, t, flags in extra]
        groups.append(passes)
    return groups


def dropped_layout(
    order: list[int], keep: torch.Tensor, refill: torch.Tensor, n_batches: int, seed: int, step: int
) -> tuple[list[list[int]], list[list[bool] | None]]:
    """flow_grpo's layout of the samples that train (``scripts/train_sd3.py`` at ac4c86e,
    right after the advantages): every sample whose advantage is 0 across its steps is
    dropped; if the kept count is not a multiple of the micro-batch count, as many dropped
    ones as are missing come back (only when there are enough; flow_grpo picks them with
    ``torch.randperm``, we key the pick by (seed, iteration), so every inner epoch has the
    same); the kept samples, in the epoch's shuffled ``order``, fill ``n_batches``
    micro-batches of equal size, which is what each sample's loss is averaged over.

    ``keep`` marks the samples that stay, ``refill`` those that may come back. Returns the
    micro-batches and each one's ``counted`` flags (None: every row counts). Where nothing
    is left for a micro-batch, it forwards one dead row that counts nowhere, so that every
    process still runs the same passes (flow_grpo would stop there)."""
    kept = keep.bool().clone()
    short = (-int(kept.sum())) % n_batches
    spare = torch.nonzero(refill.bool() & ~kept).flatten()
    if short and len(spare) >= short:
        chosen = torch.randperm(len(spare), generator=rng.generator(seed, "refill", step))[:short]
        kept[spare[chosen]] = True
    rows = [i for i in order if bool(kept[i])]
    cuts = [round(k * len(rows) / n_batches) for k in range(n_batches + 1)]
    batches = [rows[cuts[k] : cuts[k + 1]] for k in range(n_batches)]
    counted = [None if batch else [False] for batch in batches]
    return [batch or order[:1] for batch in batches], counted


def step_edge_counts(train: torch.Tensor, depth: torch.Tensor, cfg) -> dict[int, int]:
    """Edges per denoising step that :func:`edge_major` trains (after the timestep
    fraction): what processes compare to agree on one pass structure."""
    counts = {}
    for t in sorted(set((depth[train] - 1).tolist())):
        n = sum((train & (depth - 1 == t)).tolist())  # host lists: no scalar read per step
        counts[t] = max(1, math.ceil(PassSettings.of(cfg).timestep_fraction * n))
    return counts


def edge_major(
    train: torch.Tensor,
    depth: torch.Tensor,
    num_leaves: int,
    cfg,
    step: int,
    epoch: int,
    keep: torch.Tensor | None = None,
    pad_to: dict[int, int] | None = None,
    mean_over_processes: Callable[[list[int]], list[float]] | None = None,
) -> list[list[Pass]]:
    """Passes over the nodes with ``train`` set (each node stands for its incoming edge,
    at step depth - 1); ``keep`` marks the ones whose loss is not masked out.

    ``pad_to`` (step -> edge count, the maximum over processes) pads each step with
    dead rows so that every process runs the same passes of the same sizes, which DDP
    needs when trees differ in shape (Sol-RL sub-trees): a dead row repeats a node at that
    depth, is forwarded with weight 0 and counts in no denominator.

    ``mean_over_processes`` (several processes) averages live-edge counts over the
    processes, and the denominators use those means: DDP and FSDP average gradients over
    processes, so with denominators of ``P * mean = `` the live edges of *all* processes,
    every live edge of an optimizer step weighs the same, as on one process. With local
    denominators, an edge of a smaller sub-tree would weigh more."""
    s = PassSettings.of(cfg)
    keep = torch.ones_like(train) if keep is None else keep.bool()
    counts = step_edge_counts(train, depth, s)
    n_groups = _tree_optimizer_steps(num_leaves, counts, pad_to, s)
    per_group: list[list[tuple[int, torch.Tensor, int]]] = [[] for _ in range(n_groups)]
    for t in sorted(set(counts) | set(pad_to or {})):
        # keyed by (seed, iteration, epoch, step): a resumed run shuffles the same way
        _spread_step(
            per_group,
            t,
            torch.nonzero(train & (depth - 1 == t)).flatten(),
            counts.get(t, 0),  # the timestep_fraction share of this step
            (pad_to or {}).get(t, 0),
            torch.nonzero(depth - 1 == t).flatten()[:1],
            rng.generator(s.seed, "edges", step, epoch, t),
        )
    groups = [parts for parts in per_group if parts]
    live = [[sum(a.tolist()) for _, _, a in parts] for parts in groups]
    if mean_over_processes is not None:  # one collective for every group (same layout everywhere)
        means = iter(mean_over_processes([n for counts in live for n in counts]))
        live = [[next(means) for _ in counts] for counts in live]
    return [_group_passes(parts, keep, s, counts) for parts, counts in zip(groups, live, strict=True)]


def _tree_optimizer_steps(num_leaves: int, counts: dict, pad_to: dict | None, s: PassSettings) -> int:
    """Optimizer steps of a tree plan: as many as the leaves make (ceil(leaves /
    (micro_batch x accumulation))), or with ``tree.edges_per_step`` N, one per N trained
    edges, as BranchGRPO's loop steps after every ``gradient_accumulation_steps`` edges
    (``fastvideo/train_branchgrpo_flux.py``). The edge count is the padded one, the same
    on every process."""
    if s.edges_per_step <= 0:
        return optimizer_steps_per_epoch(num_leaves, s)
    pad_to = pad_to or {}
    edges = sum(max(counts.get(t, 0), pad_to.get(t, 0)) for t in set(counts) | set(pad_to))
    return max(1, math.ceil(edges / s.edges_per_step))


def _spread_step(
    per_group: list[list[tuple[int, torch.Tensor, torch.Tensor]]],
    t: int,
    candidates: torch.Tensor,
    count: int,
    pad: int,
    filler: torch.Tensor,
    generator: torch.Generator,
) -> None:
    """A keyed ``count`` of step ``t``'s ``candidates`` (node ids), padded to ``pad`` rows
    with dead copies of ``filler`` (a real node at that depth, forwarded with weight 0: DDP
    padding), spread over the optimizer steps in ``per_group`` as (t, rows, alive). The
    offset t rotates which optimizer step gets the remainder, so a step with fewer rows
    than optimizer steps does not always land in the first ones."""
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count]]
    live = len(chosen)
    target = max(live, pad)
    rows = torch.cat([chosen, filler.repeat(target - live)]) if target > live else chosen
    alive = torch.arange(target) < live
    n = len(per_group)
    for i, (part, part_live) in enumerate(zip(torch.tensor_split(rows, n), torch.tensor_split(alive, n))):
        if len(part):
            per_group[(i + t) % n].append((t, part, part_live))


def _group_passes(
    parts: list[tuple[int, torch.Tensor, torch.Tensor]], keep: torch.Tensor, s: PassSettings, live: list
) -> list[Pass]:
    """Chunk one optimizer step's per-step edge sets into passes of at most
    ``micro_batch_size`` rows. The objective averages over a pass's kept rows, so the
    share's numerator is the kept count and its denominator counts every live edge: a
    masked edge weighs as a zero loss, and the result does not depend on how edges fall
    into passes. ``live`` holds each part's live-edge count (this process's, or the mean
    over processes; see :func:`edge_major`)."""
    mb = s.micro_batch_size
    total = sum(live) or 1
    live_steps = sum(n > 0 for n in live) or 1  # an all-padding step weighs nothing
    passes = []
    for (t, part, alive), live_here in zip(parts, live, strict=True):
        den = (live_here or 1) * live_steps if s.loss_weighting == "depth" else total
        for i in range(0, len(part), mb):
            chunk, chunk_live = part[i : i + mb], alive[i : i + mb]
            counted = (keep[chunk] & chunk_live).tolist()
            flags = None if all(counted) else counted
            passes.append(Pass(chunk.tolist(), t, (sum(counted), den), flags))
    return passes


def tree_anchor_counts(depth: torch.Tensor, anchored, cfg) -> dict[int, int]:
    """Anchor rows per untrained step that :func:`add_tree_anchors` plans:
    ceil(``objective.anchor_fraction`` x the nodes at that step), as
    :func:`step_edge_counts` is for edges (what processes compare)."""
    fraction = PassSettings.of(cfg).anchor_fraction
    at_depth = torch.bincount(depth, minlength=max(anchored, default=0) + 2).tolist()  # one host read
    return {t: math.ceil(fraction * at_depth[t + 1]) for t in anchored if at_depth[t + 1]}


def add_tree_anchors(
    groups: list[list[Pass]],
    depth: torch.Tensor,
    anchored,
    cfg,
    step: int,
    epoch: int,
    keep: torch.Tensor | None = None,
    pad_to: dict[int, int] | None = None,
) -> list[list[Pass]]:
    """``groups`` (:func:`edge_major`'s optimizer steps) with velocity-anchor passes on a
    tree's untrained steps ``anchored`` (its ODE steps) appended.

    The state x_t of a node at ODE step t is anchored through its edge into its only
    child (splits are stochastic, so an ODE step never branches): a row is that child,
    which :meth:`TreeTrajectory.transition` maps back to x_t. Each step keeps a keyed
    :func:`tree_anchor_counts` share of its nodes, spread over the optimizer steps like
    edges. ``keep`` (per node) weighs a row 0 when False. ``pad_to`` (step -> count, the
    maximum over processes) pads with dead rows as :func:`edge_major` does, so every
    process runs the same passes. The anchor passes of an optimizer step average over
    its counted anchor rows, apart from the policy passes (the policy loss is not
    rescaled), as in :func:`sample_major`.

    The term is ours (no reference implementation): DiffusionNFT's velocity-space KL
    (Zheng et al. 2025, Sec. 3) at the steps BranchGRPO's edges (Li et al. 2025) leave
    untrained; see :mod:`diffrl.algorithms.anchor`."""
    s = PassSettings.of(cfg)
    if not groups:
        return groups
    keep = torch.ones_like(depth, dtype=torch.bool) if keep is None else keep.bool()
    counts, n = tree_anchor_counts(depth, anchored, s), len(groups)
    parts: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
    for t in sorted(set(counts) | set(pad_to or {})):
        children = torch.nonzero(depth == t + 1).flatten()
        generator = rng.generator(s.seed, "anchor", step, epoch, t)
        _spread_step(parts, t, children, counts.get(t, 0), (pad_to or {}).get(t, 0), children[:1], generator)
    parts = [[(t, rows, alive & keep[rows]) for t, rows, alive in mine] for mine in parts]
    return [passes + _anchor_passes(mine, s.micro_batch_size) for passes, mine in zip(groups, parts)]


def _anchor_passes(parts: list[tuple[int, torch.Tensor, torch.Tensor]], mb: int) -> list[Pass]:
    """One optimizer step's anchor rows in passes of at most ``mb`` rows, each weighted by
    its counted rows over the step's counted anchor rows (1 if none count)."""
    den = sum(sum(live.tolist()) for _, _, live in parts) or 1
    passes = []
    for t, part, live in parts:
        for i in range(0, len(part), mb):
            counted = live[i : i + mb].tolist()
            flags = None if all(counted) else counted
            passes.append(Pass(part[i : i + mb].tolist(), t, (sum(counted), den), flags, anchor=True))
    return passes
