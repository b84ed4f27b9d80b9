"""Samplers: SDE/ODE steps with log-prob, keyed RNG, and rollout strategies by name.

A rollout strategy has the signature
``strategy(adapter, transformer, cond, keys, cfg) -> Trajectory`` so that the trainer
can swap independent rollouts for a tree sampler or a low-precision pool.
"""

from __future__ import annotations

from diffrl.sampling.rollout import Trajectory, rollout_independent
from diffrl.sampling.sde import STEP_KINDS, gaussian_kl, gaussian_log_prob, step

_STRATEGIES = {"independent": rollout_independent}


def register_strategy(name: str, fn) -> None:
    _STRATEGIES[name] = fn


def available_strategies() -> list[str]:
    return sorted(_STRATEGIES)


def get_strategy(name: str):
    if name not in _STRATEGIES:
        raise ValueError(f"unknown rollout strategy '{name}'; valid: {', '.join(available_strategies())}")
    return _STRATEGIES[name]


__all__ = ["STEP_KINDS", "Trajectory", "available_strategies", "gaussian_kl", "gaussian_log_prob",
           "get_strategy", "register_strategy", "rollout_independent", "step"]
