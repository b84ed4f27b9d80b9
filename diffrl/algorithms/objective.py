"""The objective interface: what an objective trains on and what it needs.

An objective turns one forward pass (a :class:`StepBatch`: rows of one denoising step)
into a loss, given a :class:`LossContext` (the velocities of the policy, the reference
and, if needed, the old policy). :class:`Objective` says which data it trains on:

* ``transitions``: stored rollout transitions x_t -> x_{t+1} with their log-probs
  (flow-GRPO): only stochastic steps are trainable, and replay must reproduce the
  rollout's numerics.
* ``clean_samples``: the final clean latents, noised afresh at any step (the forward
  process, DiffusionNFT): no log-probs, any sampler, every step trainable.

``needs_old_policy`` asks the trainer for an EMA old policy (DiffusionNFT's v_old, AWM's
EMA anchor). ``whole_groups`` asks for passes that hold whole prompt groups, noised with
one draw per group (DGPO's group-level preference needs every member at once).
``strategies`` lists what the objective supports among independent rollouts, trees and
Sol-RL's regenerated subsets ("solrl"); a clean-sample objective trains a tree's leaves,
grouped by tree (the tree's per-node credit is then unused). ``args`` is the dataclass of
the objective's own parameters, declared in its module with a help text per field and a
``check()`` of their ranges; the config's ``objective.args`` mapping is read into it, as
a reward's ``args`` into its constructor, and losses read it as ``ctx.objective_cfg.args``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from diffrl.models.base import Conditioning
from diffrl.schema import ConfigError, setting
from rewards.registry import Registry


@dataclass(frozen=True)
class NoArgs:
    """The parameters of an objective that has none of its own (``objective.args: {}``)."""

    def check(self) -> None:
        """Each objective's parameters check their own ranges, naming ``objective.args.KEY``."""


@dataclass(frozen=True)
class OldPolicyArgs:
    """The old policy's decay schedule, an EMA of the trained weights whose decay ramps with
    the optimizer steps s: 0 while s < old_decay_flat, then min(old_decay_rate *
    (s - old_decay_flat), old_decay_max) (NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py:
    return_decay``; AWM's EMA with max 0.3). Shared by the objectives that need an old policy."""

    old_decay_flat: int = setting(
        0, "Old policy: optimizer steps with decay 0 (old = current) before the ramp."
    )
    old_decay_rate: float = setting(
        0.001, "Old policy: the decay grows by this per optimizer step after the flat part."
    )
    old_decay_max: float = setting(0.5, "Old policy: the decay stops growing here.")

    def check(self) -> None:
        if self.old_decay_flat < 0 or self.old_decay_rate < 0 or not 0 <= self.old_decay_max < 1:
            raise ConfigError(
                "objective.args.old_decay_flat and old_decay_rate must be >= 0, old_decay_max in [0, 1)"
            )


@dataclass
class StepBatch:
    """One denoising step of a micro-batch, read from a Trajectory."""

    x_t: torch.Tensor
    x_next: torch.Tensor
    sigma: torch.Tensor  # scalar
    sigma_next: torch.Tensor  # scalar
    sigma_1: float | None
    kind: str
    old_log_prob: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)
    cond: Conditioning
    weights: torch.Tensor | None = None  # (B,) 1 = train on the sample, 0 = masked out
    noise_level: float | None = None  # the step rule's noise level at this step (None: the context's)
    x0: torch.Tensor | None = None  # clean final latents (forward-process objectives: DiffusionNFT)
    old_mean: torch.Tensor | None = None  # the rollout's transition mean of x_t -> x_next
    groups: torch.Tensor | None = None  # (B,) long: rows with the same value share a prompt group
    forward_noise: torch.Tensor | None = (
        None  # the eps of x_t = (1 - sigma) x0 + sigma eps (clean-sample objectives)
    )


def per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (B,): the mean over every dimension but the batch."""
    return x.flatten(1).mean(1)


def masked_mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Mean over samples with weight 1. Masking (rather than dropping) keeps every process
    running the same forwards, which DDP's collective backward requires."""
    if weights is None:
        return values.mean()
    return (values * weights).sum() / weights.sum().clamp(min=1.0)


def velocity_gap(v: torch.Tensor, other: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """masked_mean over rows of mean_d (v - other)^2: the velocity-space penalties (the
    reference KL of the clean-sample objectives, AWM's EMA anchor)."""
    return masked_mean(per_sample_mean((v - other.detach()) ** 2), weights)


def reference_velocity_gap(ctx: LossContext, batch: StepBatch, v: torch.Tensor) -> torch.Tensor:
    """velocity_gap of ``v`` to the reference's velocity on the same noised input (no
    gradient through the reference): the clean-sample objectives' KL term."""
    with torch.no_grad():
        v_ref = ctx.reference_velocity(batch.x_t, batch.sigma.expand(batch.x_t.shape[0]), batch.cond)
    return velocity_gap(v, v_ref, batch.weights)


def add_penalty(loss: torch.Tensor, stats: dict, key: str, value: torch.Tensor, coef: float) -> torch.Tensor:
    """``loss + coef * value``, logging ``value`` as ``stats[key]``."""
    stats[key] = value.detach()
    return loss + coef * value


@dataclass
class LossContext:
    """What an objective may call: velocities of the policy (with grad) and reference."""

    policy_velocity: Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]
    reference_velocity: Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor] | None
    objective_cfg: object
    noise_level: float
    old_velocity: Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor] | None = (
        None  # NFT's old policy
    )


@dataclass(frozen=True)
class Objective:
    name: str
    loss: Callable  # (LossContext, StepBatch) -> (loss, stats)
    trains_on: Literal["transitions", "clean_samples"] = "transitions"
    needs_old_policy: bool = False
    whole_groups: bool = False
    strategies: tuple[str, ...] = ("independent", "tree", "solrl")
    args: type = NoArgs  # the dataclass of its own parameters, read from objective.args

    @property
    def forward_process(self) -> bool:
        """Trains on clean samples noised afresh (every step's sigma is usable)."""
        return self.trains_on == "clean_samples"

    def __call__(self, ctx: LossContext, batch: StepBatch):
        return self.loss(ctx, batch)


OBJECTIVES = Registry("objective")


def register_objective(objective: Objective) -> None:
    OBJECTIVES.register(objective.name, objective)


def get_objective(name: str) -> Objective:
    return OBJECTIVES.get(name)


def available_objectives() -> list[str]:
    return OBJECTIVES.available()
