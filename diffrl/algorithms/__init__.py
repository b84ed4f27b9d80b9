"""Advantage estimators and policy objectives (selected by name from the config)."""

from diffrl.algorithms.advantages import ESTIMATORS, Advantages, compute_advantages
from diffrl.algorithms.flow_grpo import (
    LossContext,
    StepBatch,
    available_objectives,
    flow_grpo_loss,
    get_objective,
    register_objective,
)

__all__ = ["ESTIMATORS", "Advantages", "LossContext", "StepBatch", "available_objectives",
           "compute_advantages", "flow_grpo_loss", "get_objective", "register_objective"]
