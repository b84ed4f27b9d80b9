"""Advantage estimators and policy objectives (selected by name from the config).

Importing this package registers the built-in objectives (flow_grpo, grpo_guard,
flow_dppo, nft, awm, dgpo); see
:mod:`diffrl.algorithms.objective` for the interface a new one implements.
"""

from diffrl.algorithms.advantages import ESTIMATORS, Advantages, compute_advantages
from diffrl.algorithms.awm import awm_loss
from diffrl.algorithms.dgpo import dgpo_loss
from diffrl.algorithms.flow_dppo import flow_dppo_loss
from diffrl.algorithms.flow_grpo import flow_grpo_loss
from diffrl.algorithms.grpo_guard import GRPO_GUARD
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
    "GRPO_GUARD",
    "LossContext",
    "Objective",
    "StepBatch",
    "available_objectives",
    "awm_loss",
    "compute_advantages",
    "dgpo_loss",
    "flow_dppo_loss",
    "flow_grpo_loss",
    "nft_loss",
    "get_objective",
    "register_objective",
]
