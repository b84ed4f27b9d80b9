"""The per-iteration sample plan (prompt files are read by :mod:`diffrl.data.prompts`).

The plan for iteration ``step`` depends only on (seed, step), never on global RNG
state, so resuming at step k reproduces exactly the prompts and noise keys an
uninterrupted run would have used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.sampling import rng


@dataclass
class SamplePlan:
    """The samples of one iteration, in global order (group-major)."""

    prompts: list[str]  # (N,)
    group_ids: torch.Tensor  # (N,) group index within the step
    keys: list[tuple]  # (N,) RNG keys (seed, step, group, sample)

    def shard(self, rank: int, world: int) -> tuple[slice, SamplePlan]:
        """Contiguous block of this process; groups may straddle processes (stats are gathered)."""
        n = len(self.prompts)
        if n % world:
            raise ValueError(
                f"{n} samples per step cannot be split over {world} processes; make "
                "rollout.prompts_per_step * rollout.group_size divisible by the process count"
            )
        per = n // world
        sl = slice(rank * per, (rank + 1) * per)
        return sl, SamplePlan(self.prompts[sl], self.group_ids[sl], self.keys[sl])


def plan_step(prompts: list[str], seed: int, step: int, prompts_per_step: int, group_size: int) -> SamplePlan:
    """Choose ``prompts_per_step`` prompts for ``step`` (without replacement when possible)
    and lay out ``group_size`` samples of each."""
    gen = rng.generator(seed, "prompts", step)
    order = torch.cat(
        [torch.randperm(len(prompts), generator=gen) for _ in range(-(-prompts_per_step // len(prompts)))]
    )[:prompts_per_step]
    chosen, group_ids, keys = [], [], []
    for g, idx in enumerate(order.tolist()):
        for s in range(group_size):
            chosen.append(prompts[idx])
            group_ids.append(g)
            keys.append((seed, step, g, s))
    return SamplePlan(chosen, torch.tensor(group_ids), keys)
