"""The run configuration's schema: one dataclass per section, every field with its default
and a help text (``metadata["help"]``), and :class:`ConfigError`, the one error bad
configuration input raises. Loading YAML into it, overrides and the cross-field checks
are :mod:`diffrl.config`'s; each feature checks its own settings beside it
(``diffrl/sampling/checks.py``...), and each objective declares its own parameters
(``objective.args``) in its module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diffrl.schema.fields import ConfigError, _f, setting
from diffrl.schema.model import LoraConfig, ModelConfig
from diffrl.schema.precision import PerfConfig, PrecisionConfig, SolRLConfig
from diffrl.schema.refiner import RefinerConfig
from diffrl.schema.run import (
    AdvantageConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    GuardConfig,
    LoggingConfig,
    ObjectiveConfig,
    OptimConfig,
    RewardSpec,
    TrainConfig,
)
from diffrl.schema.sampling import RolloutConfig, SamplingConfig, TreeConfig

__all__ = [
    "AdvantageConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "GuardConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OptimConfig",
    "PerfConfig",
    "PrecisionConfig",
    "RefinerConfig",
    "RewardSpec",
    "RolloutConfig",
    "SamplingConfig",
    "SolRLConfig",
    "TrainConfig",
    "TreeConfig",
    "setting",
]


@dataclass
class Config:
    run_name: str = _f("run", "Run name; the default output_dir is outputs/<run_name>.")
    output_dir: str | None = _f(None, "Run directory; null means outputs/<run_name>.")
    seed: int = _f(0, "Master seed: every random draw derives from it and the step.")
    model: ModelConfig = _f(ModelConfig(), "Model family and weights.")
    sampling: SamplingConfig = _f(SamplingConfig(), "SDE/ODE step settings.")
    rollout: RolloutConfig = _f(RolloutConfig(), "Rollout batch arithmetic.")
    tree: TreeConfig = _f(TreeConfig(), "Tree sampler (rollout.strategy: tree).")
    solrl: SolRLConfig = _f(SolRLConfig(), "Low-precision exploration pool, selection and BF16 regeneration.")
    precision: PrecisionConfig = _f(
        PrecisionConfig(), "FP8 rollouts and training forward from one quantizer (Jet-RL's unified flow)."
    )
    perf: PerfConfig = _f(PerfConfig(), "Speed switches measured by scripts/bench_rollout.py.")
    data: DataConfig = _f(DataConfig(), "Prompt files.")
    rewards: list[RewardSpec] = _f([RewardSpec()], "Rewards combined by weight.")
    advantage: AdvantageConfig = _f(AdvantageConfig(), "Advantage estimator.")
    objective: ObjectiveConfig = _f(ObjectiveConfig(), "Policy objective.")
    optim: OptimConfig = _f(OptimConfig(), "Optimizer.")
    refiner: RefinerConfig = _f(
        RefinerConfig(), "PromptRL's prompt-refining LM, trained with GRPO beside the flow model."
    )
    train: TrainConfig = _f(TrainConfig(), "Training loop.")
    eval: EvalConfig = _f(EvalConfig(), "Held-out evaluation.")
    guard: GuardConfig = _f(
        GuardConfig(), "Rules on the gold panel and the monitors that warn, keep the best checkpoint, stop."
    )
    logging: LoggingConfig = _f(LoggingConfig(), "Metrics and trackers.")
    checkpoint: CheckpointConfig = _f(CheckpointConfig(), "Checkpointing.")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or f"outputs/{self.run_name}")
