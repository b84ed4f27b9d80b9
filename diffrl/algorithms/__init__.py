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
from diffrl.algorithms.nft import nft_loss

register_objective("nft", nft_loss)

__all__ = ["ESTIMATORS", "Advantages", "LossContext", "StepBatch", "available_objectives",
           "compute_advantages", "flow_grpo_loss", "nft_loss", "get_objective", "register_objective"]
