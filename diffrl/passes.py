"""How an iteration's transitions are split into forward passes and optimizer steps.

A :class:`Pass` is one forward of the objective: rows of one trajectory at one
denoising step (a scalar sigma). An optimizer step accumulates a list of passes; each
pass's mean loss is weighted by ``share`` so that the step averages over its
transitions.

* Independent trajectories (:func:`sample_major`): the process's samples are shuffled
  (keyed by seed, iteration and epoch), cut into micro-batches, and each micro-batch is
  trained on a keyed subset of the trainable steps (``objective.timestep_fraction``),
  as flow_grpo does.
* Trees (:func:`edge_major`): the trained edges of each step are shuffled and spread
  evenly over the optimizer steps, so every optimizer step sees every step, and the
  number of passes depends only on per-step edge counts, which are the same on every
  process (DDP needs the same forwards everywhere). ``timestep_fraction`` keeps that
  share of each step's edges. With ``tree.loss_weighting: edge`` every edge weighs the
  same in the loss (BranchGRPO), so wide late steps dominate; with ``depth`` each step's
  edges share an equal part, as each step does for independent rollouts.

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


def optimizer_steps_per_epoch(samples: int, cfg) -> int:
    return math.ceil(math.ceil(samples / cfg.train.micro_batch_size) / cfg.train.gradient_accumulation)


def train_timesteps(trainable: list[int], fraction: float, *key) -> list[int]:
    """A keyed random subset of ceil(fraction * len) trainable steps, in time order."""
    k = max(1, math.ceil(fraction * len(trainable)))
    if k >= len(trainable):
        return list(trainable)
    perm = torch.randperm(len(trainable), generator=rng.generator(*key))[:k]
    return sorted(trainable[i] for i in perm.tolist())


def sample_major(n: int, trainable: list[int], cfg, step: int, epoch: int) -> list[list[Pass]]:
    mb, accum = cfg.train.micro_batch_size, cfg.train.gradient_accumulation
    order = torch.randperm(n, generator=rng.generator(cfg.seed, "shuffle", step, epoch)).tolist()
    batches = [order[i:i + mb] for i in range(0, n, mb)]
    groups = []
    for start in range(0, len(batches), accum):
        pairs = [(idx, t) for j, idx in enumerate(batches[start:start + accum])
                 for t in train_timesteps(trainable, cfg.objective.timestep_fraction, cfg.seed, "t", step, epoch,
                                          start, j)]
        groups.append([Pass(idx, t, (1, len(pairs))) for idx, t in pairs])
    return groups


def edge_major(train: torch.Tensor, depth: torch.Tensor, num_leaves: int, cfg, step: int, epoch: int) -> list[list[Pass]]:
    """Passes over the nodes with ``train`` set (each node stands for its incoming edge,
    at step depth - 1)."""
    n_groups = optimizer_steps_per_epoch(num_leaves, cfg)
    per_group: list[list[torch.Tensor]] = [[] for _ in range(n_groups)]
    steps = sorted(set((depth[train] - 1).tolist()))
    for t in steps:
        edges = torch.nonzero(train & (depth - 1 == t)).flatten()
        perm = torch.randperm(len(edges), generator=rng.generator(cfg.seed, "edges", step, epoch, t))
        edges = edges[perm[:max(1, math.ceil(cfg.objective.timestep_fraction * len(edges)))]]
        for g, part in enumerate(torch.tensor_split(edges, n_groups)):
            per_group[g].append(part)
    groups = []
    mb, by_depth = cfg.train.micro_batch_size, cfg.tree.loss_weighting == "depth"
    for parts in per_group:
        total, filled = sum(len(p) for p in parts), sum(1 for p in parts if len(p))
        passes = [Pass(p[i:i + mb].tolist(), t, (len(p[i:i + mb]), len(p) * filled if by_depth else total))
                  for t, p in zip(steps, parts) for i in range(0, len(p), mb)]
        if passes:
            groups.append(passes)
    return groups
