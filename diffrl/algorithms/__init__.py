"""Advantage estimators and policy objectives (selected by name from the config).

Importing this package registers the built-in objectives (flow_grpo, nft); see
:mod:`diffrl.algorithms.objective` for the interface a new one implements.
"""

from diffrl.algorithms.advantages import ESTIMATORS, Advantages, compute_advantages
from diffrl.algorithms.flow_grpo import flow_grpo_loss
from diffrl.algorithms.nft import nft_loss
from diffrl.algorithms.objective import (
    LossContext,
    Objective,
    StepBatch,
    available_objectives,
    get_objective,
    register_objective,
)

__all__ = [
    "ESTIMATORS",
    "Advantages",
    "LossContext",
    "Objective",
    "StepBatch",
    "available_objectives",
    "compute_advantages",
    "flow_grpo_loss",
    "nft_loss",
    "get_objective",
    "register_objective",
]
