"""The branching schedule of a BranchGRPO tree (Li et al. 2025, "BranchGRPO", Sec. 3.1):
children per node at each step, the split-noise scale, and the closed forms that follow
from them (nodes per depth, leaves, NFE, the level-major node layout). Pure arithmetic:
the run plan reads it without building a model. :mod:`diffrl.sampling.tree` grows trees
by it and re-exports it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeSpec:
    """The branching schedule of one tree: ``factors[t]`` children per node at step t."""

    factors: tuple[int, ...]
    split_noise_scale: float = 1.0
    split_noise: str = "level"  # "level": scale the step's noise level; "draw": only the drawn noise
    root_block: int = 1  # tree.shared_root_noise: consecutive trees sharing one root noise

    @classmethod
    def build(
        cls,
        num_steps: int,
        split_steps,
        branch_factors,
        split_noise_scale: float = 1.0,
        split_noise: str = "level",
        root_block: int = 1,
    ) -> TreeSpec:
        if split_noise not in ("level", "draw"):
            raise ValueError(f"tree.split_noise must be 'level' or 'draw', got '{split_noise}'")
        splits = list(split_steps)
        per_split = list(branch_factors) * len(splits) if len(branch_factors) == 1 else list(branch_factors)
        factors = [1] * num_steps
        for s, f in zip(splits, per_split):
            factors[s] = int(f)
        return cls(tuple(factors), float(split_noise_scale), split_noise, int(root_block))

    @classmethod
    def from_config(cls, cfg) -> TreeSpec:
        t = cfg.tree  # a Config or SamplerSettings: both have .sampling and .tree
        return cls.build(
            cfg.sampling.num_steps,
            t.split_steps,
            t.branch_factors,
            t.split_noise_scale,
            t.split_noise,
            t.shared_root_noise,
        )

    @property
    def num_steps(self) -> int:
        return len(self.factors)

    @property
    def split_steps(self) -> list[int]:
        return [t for t, f in enumerate(self.factors) if f > 1]

    @property
    def last_split(self) -> int:
        return max(self.split_steps, default=-1)

    def nodes_at(self, depth: int) -> int:
        """Nodes per tree at ``depth`` (depth t holds x_t; the root is depth 0)."""
        return math.prod(self.factors[:depth])

    def branched(self, depth: torch.Tensor) -> torch.Tensor:
        """Bool per entry of ``depth``: the tree has more than one node there (a depth with
        one node, the trunk before the first split, always gets a zero advantage)."""
        table = torch.tensor([self.nodes_at(d) > 1 for d in range(self.num_steps + 1)])
        return table[depth]

    @property
    def leaves(self) -> int:
        return self.nodes_at(self.num_steps)

    def nfe_per_tree(self) -> int:
        """Closed form: step t evaluates the transformer once per node at depth t."""
        return sum(self.nodes_at(t) for t in range(self.num_steps))

    def _split_scale(self, mode: str) -> list[float]:
        return [self.split_noise_scale if f > 1 and self.split_noise == mode else 1.0 for f in self.factors]

    def noise_levels(self, base: float) -> list[float]:
        """The step rule's noise level per step (scaled at splits in ``level`` mode)."""
        return [base * k for k in self._split_scale("level")]

    def draw_scales(self) -> list[float]:
        """Factor on the drawn noise per step (the split scale at splits in ``draw`` mode)."""
        return self._split_scale("draw")

    def layout(self, num_trees: int) -> dict[str, torch.Tensor]:
        """depth, tree, ordinal and parent (-1 for roots) of every node, level-major."""
        depth, tree, ordinal, parent = [], [], [], []
        offset = 0
        for d in range(self.num_steps + 1):
            n = self.nodes_at(d)
            depth.append(torch.full((num_trees * n,), d))
            tree.append(torch.arange(num_trees).repeat_interleave(n))
            ordinal.append(torch.arange(n).repeat(num_trees))
            if d == 0:
                parent.append(torch.full((num_trees,), -1))
            else:
                prev = self.nodes_at(d - 1)
                parent.append(
                    offset - num_trees * prev + tree[-1] * prev + ordinal[-1] // self.factors[d - 1]
                )
            offset += num_trees * n
        return {
            k: torch.cat(v)
            for k, v in (("depth", depth), ("tree", tree), ("ordinal", ordinal), ("parent", parent))
        }
