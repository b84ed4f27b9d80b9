"""What the stages of one iteration hand each other (docs/ARCHITECTURE.md, "One
iteration"): the rollout stage returns a :class:`Rollout`, the credit stage a
:class:`Credit`, and the update stage reads both."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffrl.sampling.tree import TreeTrajectory


@dataclass
class Rollout:
    """This process's scored samples of one iteration (for Sol-RL: the regenerated BF16
    subset; nothing downstream sees the exploration pool)."""

    traj: object  # Trajectory (independent paths) or TreeTrajectory (BranchGRPO)
    cond: object  # Conditioning, indexed like ``traj`` (tree: one row per tree's prompt)
    groups: torch.Tensor  # (B,) group id per sample: advantages are normalised within a group
    total: torch.Tensor  # (B,) combined reward
    components: torch.Tensor  # (B, K) per-reward scores
    logs: dict[str, torch.Tensor]  # every logged score per sample (NaN where one does not apply)
    stage_metrics: dict[str, float]  # times, NFE and Sol-RL diagnostics of this process
    nfe: int  # transformer evaluations of this process
    rewrites: object = None  # PromptRL: the refiner's Rewrites the images were rendered from

    @property
    def is_tree(self) -> bool:
        return isinstance(self.traj, TreeTrajectory)


@dataclass
class Credit:
    """Advantages and masks for this process's samples (independent rollouts) or tree nodes.

    ``keep`` says whether a sample's (node's) loss counts: zero-variance groups, median
    pivots and groups with a non-finite reward are forwarded with weight 0, so that every
    process runs the same forwards. ``edges`` exists for trees only: whether the edge into
    each node is forwarded at all (pruning and single-node depths remove edges)."""

    all_rewards: torch.Tensor  # every process's combined rewards, for logging
    advantages: torch.Tensor
    keep: torch.Tensor
    filtered_fraction: float  # share of groups masked for zero variance
    dropped_groups: int  # groups left out for a non-finite reward
    edges: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)
    # advantage.drop_zero (independent rollouts): the samples with advantage exactly 0 that
    # may come back to fill the micro-batches evenly (``keep`` is then False for all of them)
    refill: torch.Tensor | None = None
