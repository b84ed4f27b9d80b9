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
  ShapeWorld training fell apart: docs/BENCHMARKS.md.)

Both give the same number of optimizer steps per epoch for the same number of samples
(leaves): ceil(ceil(samples / micro_batch_size) / gradient_accumulation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffrl.sampling import rng


@dataclass
class Pass:
    rows: list[int]  # sample indices (independent) or node indices (tree)
    t: int  # denoising step
    share: tuple[int, int]  # (numerator, denominator): weight of the pass's mean loss in its optimizer step
    live: list[bool] | None = None  # False for padding rows (forwarded for DDP, weight 0); None: all live
    anchor: bool = False  # a velocity-anchor pass on an untrained step (diffrl.algorithms.anchor)


def optimizer_steps_per_epoch(samples: int, cfg) -> int:
    return math.ceil(math.ceil(samples / cfg.train.micro_batch_size) / cfg.train.gradient_accumulation)


def trained_step_count(fraction: float, n: int) -> int:
    """Steps trained per sample out of ``n``: max(1, int(fraction * n)), rounded down as
    flow_grpo (``scripts/train_sd3.py``: ``int(num_steps * timestep_fraction)``) and
    DiffusionNFT do, so fraction 0.99 of 10 steps trains 9."""
    return max(1, int(fraction * n))


def train_timesteps(trainable: list[int], fraction: float, *key, round_up: bool = False) -> list[int]:
    """A keyed random subset of :func:`trained_step_count` trainable steps (ceil(fraction
    * len) with ``round_up``), in time order."""
    k = (
        max(1, math.ceil(fraction * len(trainable)))
        if round_up
        else trained_step_count(fraction, len(trainable))
    )
    if k >= len(trainable):
        return list(trainable)
    perm = torch.randperm(len(trainable), generator=rng.generator(*key))[:k]
    return sorted(trainable[i] for i in perm.tolist())


def sample_major(
    n: int, trainable: list[int], cfg, step: int, epoch: int, anchored: list[int] = ()
) -> list[list[Pass]]:
    """Micro-batches of samples, each trained on a keyed subset of ``trainable`` steps.
    With ``anchored`` steps, each micro-batch also gets anchor passes on a keyed subset
    of them (``objective.anchor_fraction``); policy and anchor passes are normalised
    separately, so anchoring never rescales the policy loss."""
    mb, accum = cfg.train.micro_batch_size, cfg.train.gradient_accumulation
    order = torch.randperm(n, generator=rng.generator(cfg.seed, "shuffle", step, epoch)).tolist()
    batches = [order[i : i + mb] for i in range(0, n, mb)]
    anchored = list(anchored)
    groups = []
    for start in range(0, len(batches), accum):
        chunk = list(enumerate(batches[start : start + accum]))
        pairs = [
            (idx, t)
            for j, idx in chunk
            for t in train_timesteps(
                trainable, cfg.objective.timestep_fraction, cfg.seed, "t", step, epoch, start, j
            )
        ]
        passes = [Pass(idx, t, (1, len(pairs))) for idx, t in pairs]
        if anchored:
            extra = [
                (idx, t)
                for j, idx in chunk
                for t in train_timesteps(
                    anchored,
                    cfg.objective.anchor_fraction,
                    cfg.seed,
                    "anchor",
                    step,
                    epoch,
                    start,
                    j,
                    round_up=True,
                )
            ]
            passes += [Pass(idx, t, (1, len(extra)), anchor=True) for idx, t in extra]
        groups.append(passes)
    return groups


def step_edge_counts(train: torch.Tensor, depth: torch.Tensor, cfg) -> dict[int, int]:
    """Edges per denoising step that :func:`edge_major` trains (after the timestep
    fraction): what processes compare to agree on one pass structure."""
    counts = {}
    for t in sorted(set((depth[train] - 1).tolist())):
        n = int((train & (depth - 1 == t)).sum())
        counts[t] = max(1, math.ceil(cfg.objective.timestep_fraction * n))
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
) -> list[list[Pass]]:
    """Passes over the nodes with ``train`` set (each node stands for its incoming edge,
    at step depth - 1); ``keep`` marks the ones whose loss is not masked out.

    ``pad_to`` (step -> edge count, the maximum over processes) pads each step with
    dead rows so that every process runs the same passes of the same sizes, which DDP
    needs when trees differ in shape (Sol-RL sub-trees): a dead row repeats a node at that
    depth, is forwarded with weight 0 and counts in no denominator."""
    n_groups = optimizer_steps_per_epoch(num_leaves, cfg)
    keep = torch.ones_like(train) if keep is None else keep.bool()
    per_group: list[list[tuple[int, torch.Tensor, int]]] = [[] for _ in range(n_groups)]
    counts = step_edge_counts(train, depth, cfg)
    for t in sorted(set(counts) | set(pad_to or {})):
        edges = torch.nonzero(train & (depth - 1 == t)).flatten()
        # keyed by (seed, iteration, epoch, step): a resumed run shuffles the same way
        perm = torch.randperm(len(edges), generator=rng.generator(cfg.seed, "edges", step, epoch, t))
        edges = edges[perm[: counts.get(t, 0)]]  # the timestep_fraction share of this step
        live = len(edges)
        target = max(live, (pad_to or {}).get(t, 0))
        if target > live:  # DDP padding: dead copies of a real node, forwarded with weight 0
            filler = torch.nonzero(depth - 1 == t).flatten()[:1]
            edges = torch.cat([edges, filler.repeat(target - live)])
        alive = torch.arange(target) < live
        # spread each step's edges over the optimizer steps; the offset t rotates which
        # optimizer step gets the remainder, so a step with fewer edges than optimizer
        # steps does not always land in the first ones
        for i, (part, part_live) in enumerate(
            zip(torch.tensor_split(edges, n_groups), torch.tensor_split(alive, n_groups))
        ):
            if len(part):
                per_group[(i + t) % n_groups].append((t, part, part_live))
    return [_group_passes(parts, keep, cfg) for parts in per_group if parts]


def _group_passes(parts: list[tuple[int, torch.Tensor, torch.Tensor]], keep: torch.Tensor, cfg) -> list[Pass]:
    """Chunk one optimizer step's per-step edge sets into passes of at most
    ``micro_batch_size`` rows. The objective averages over a pass's kept rows, so the
    share's numerator is the kept count and its denominator counts every live edge: a
    masked edge weighs as a zero loss, and the result does not depend on how edges fall
    into passes."""
    mb = cfg.train.micro_batch_size
    total = max(1, sum(int(a.sum()) for _, _, a in parts))
    live_steps = max(1, sum(bool(a.any()) for _, _, a in parts))  # an all-padding step weighs nothing
    passes = []
    for t, part, alive in parts:
        den = max(1, int(alive.sum())) * live_steps if cfg.tree.loss_weighting == "depth" else total
        for i in range(0, len(part), mb):
            chunk, chunk_live = part[i : i + mb], alive[i : i + mb]
            kept = int((keep[chunk] & chunk_live).sum())
            live = None if bool(chunk_live.all()) else chunk_live.tolist()
            passes.append(Pass(chunk.tolist(), t, (kept, den), live))
    return passes
