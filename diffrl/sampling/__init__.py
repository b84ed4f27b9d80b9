"""Samplers: SDE/ODE steps with log-prob, keyed RNG, and rollout strategies by name.

A rollout strategy has the signature
``strategy(adapter, transformer, cond, keys, settings, iteration=0)``, where ``settings``
is a :class:`SamplerSettings` (or a whole Config, which it narrows), returning a
:class:`Trajectory` (independent paths) or a :class:`TreeTrajectory` (BranchGRPO), so
that the trainer can swap independent rollouts for a tree sampler or a low-precision
pool. ``iteration`` places sliding SDE windows. A strategy that explores a Sol-RL pool
also takes ``keep_steps``: with ``False`` it returns a light pool (an
:class:`ExploredPool` or a :class:`TreePool`: images, keys, a tree's layout).
"""

from __future__ import annotations

from diffrl.sampling.rollout import ExploredPool, Trajectory, rollout_independent
from diffrl.sampling.sde import STEP_KINDS, gaussian_kl, gaussian_log_prob, step
from diffrl.sampling.settings import SamplerSettings
from diffrl.sampling.tree import TreePool, TreeSpec, TreeTrajectory, rollout_tree
from rewards.registry import Registry

STRATEGIES = Registry(
    "rollout strategy",
    {"independent": rollout_independent, "tree": rollout_tree},
    plural="rollout strategies",
)


def register_strategy(name: str, fn) -> None:
    STRATEGIES.register(name, fn)


def available_strategies() -> list[str]:
    return STRATEGIES.available()


def get_strategy(name: str):
    return STRATEGIES.get(name)


__all__ = [
    "ExploredPool",
    "SamplerSettings",
    "STEP_KINDS",
    "Trajectory",
    "available_strategies",
    "gaussian_kl",
    "gaussian_log_prob",
    "get_strategy",
    "register_strategy",
    "rollout_independent",
    "rollout_tree",
    "step",
    "TreePool",
    "TreeSpec",
    "TreeTrajectory",
]
