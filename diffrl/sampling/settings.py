"""What a sampler reads from the configuration, and nothing else (docs/ARCHITECTURE.md).

A rollout needs the sampling section (steps, step rule, noise level, SDE window), the run's
seed (for a randomly placed window), the
tree section for trees, the rollout batch size and the log-prob convention the
objective will compare against. :class:`SamplerSettings` gathers exactly these, so that
samplers never read the objective, the optimizer or the rewards. Samplers accept a full
:class:`~diffrl.config.Config` too and narrow it themselves (:meth:`SamplerSettings.of`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplerSettings:
    sampling: object  # diffrl.config.SamplingConfig
    tree: object  # diffrl.config.TreeConfig (read by tree rollouts only)
    batch_size: int  # rows per transformer forward (rollout.batch_size)
    logprob_reduction: str  # how step log-probs are reduced (objective.logprob_reduction)
    seed: int = 0  # the run's seed (a randomly placed SDE window is drawn from it and the iteration)
    same_noise: bool = False  # rollout.same_noise: a group's samples share their initial noise

    def evaluation_kinds(self, num_steps: int) -> list[str]:
        """The step rule of every evaluation step: Euler, except for a few-step model
        trained with ``sde_type: consistency``, which is sampled as it is trained and as
        consistency models generate (re-noised with each seed's keyed noise, so an
        evaluation is still a fixed function of its seeds)."""
        from diffrl.sampling.windows import last_step_deterministic

        kind = "consistency" if self.sampling.sde_type == "consistency" else "ode"
        return last_step_deterministic([kind] * num_steps)

    def for_evaluation(self) -> SamplerSettings:
        """What evaluations sample with: one initial noise per seed (never shared in a
        group) and Euler steps (DiffusionNFT evaluates with its "flow" solver, Euler,
        whatever its rollouts use)."""
        sampling = dataclasses.replace(self.sampling, ode_solver="euler")
        return dataclasses.replace(self, same_noise=False, sampling=sampling)

    @classmethod
    def of(cls, cfg) -> SamplerSettings:
        """``cfg`` narrowed to the sampler's settings (a SamplerSettings passes through)."""
        if isinstance(cfg, cls):
            return cfg
        return cls(
            cfg.sampling,
            cfg.tree,
            cfg.rollout.batch_size,
            cfg.objective.logprob_reduction,
            cfg.seed,
            cfg.rollout.same_noise,
        )
