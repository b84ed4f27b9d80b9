"""The policy-update stage: replay stored trajectories through the objective.

For each inner epoch, the process's samples are shuffled (keyed by seed and step, so a
resumed run shuffles identically), split into micro-batches, and every micro-batch is
trained on a keyed subset of the trainable denoising steps. Gradients accumulate over
``train.gradient_accumulation`` micro-batches per optimizer step.

A non-finite loss or gradient norm on any process skips that optimizer step on every
process (the gradient is discarded and the skip is counted), so a blow-up is never
applied.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from diffrl.algorithms.flow_grpo import LossContext, StepBatch
from diffrl.sampling import rng


@dataclass
class UpdateCounters:
    """Persistent counters (checkpointed through accelerate's registered objects)."""

    optimizer_steps: int = 0
    skipped_nonfinite_loss: int = 0
    skipped_nonfinite_reward: int = 0

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


def train_timesteps(trainable: list[int], fraction: float, *key) -> list[int]:
    """A keyed random subset of ceil(fraction * len) trainable steps, in time order."""
    k = max(1, math.ceil(fraction * len(trainable)))
    if k >= len(trainable):
        return list(trainable)
    perm = torch.randperm(len(trainable), generator=rng.generator(*key))[:k]
    return sorted(trainable[i] for i in perm.tolist())


def _any_process(accelerator, flag: bool) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)


class Updater:
    """Runs the objective over a trajectory and steps the optimizer."""

    def __init__(self, accelerator, policy, adapter, model, optimizer, scheduler, objective, cfg,
                 counters: UpdateCounters, ema=None):
        self.acc, self.policy, self.adapter, self.model = accelerator, policy, adapter, model
        self.optimizer, self.scheduler, self.objective, self.cfg = optimizer, scheduler, objective, cfg
        self.counters, self.ema = counters, ema

    def loss_context(self) -> LossContext:
        guidance = self.cfg.objective.train_cfg

        def policy_velocity(x, sigma, cond):
            return self.adapter.velocity(self.model, x, sigma, cond, guidance=guidance)

        def reference_velocity(x, sigma, cond):
            with self.policy.reference() as ref:
                return self.adapter.velocity(ref, x, sigma, cond, guidance=guidance)

        return LossContext(policy_velocity, reference_velocity, self.cfg.objective, self.cfg.sampling.noise_level)

    def run(self, traj, cond, advantages: torch.Tensor, keep: torch.Tensor, step: int) -> dict[str, float]:
        cfg = self.cfg
        ctx = self.loss_context()
        n = len(traj.keys)
        trainable = traj.trainable_steps()
        if not trainable:
            raise ValueError("no trainable denoising steps: sampling.sde_type is 'ode' or the SDE window is empty")
        totals: dict[str, list[float]] = defaultdict(list)
        mb, accum = cfg.train.micro_batch_size, cfg.train.gradient_accumulation
        for epoch in range(cfg.train.num_inner_epochs):
            order = torch.randperm(n, generator=rng.generator(cfg.seed, "shuffle", step, epoch)).tolist()
            batches = [order[i:i + mb] for i in range(0, n, mb)]
            for start in range(0, len(batches), accum):
                group = batches[start:start + accum]
                self._optimizer_step(ctx, traj, cond, advantages, keep, group, trainable, (step, epoch, start), totals)
        return {k: sum(v) / len(v) for k, v in totals.items()}

    def _optimizer_step(self, ctx, traj, cond, advantages, keep, group, trainable, key, totals) -> None:
        """Accumulate gradients over the micro-batches in ``group``, then step once."""
        bad = False
        passes = [(idx, t) for j, idx in enumerate(group)
                  for t in train_timesteps(trainable, self.cfg.objective.timestep_fraction, self.cfg.seed, "t", *key, j)]
        for i, (idx, t) in enumerate(passes):
            batch = self._step_batch(traj, cond, advantages, keep, idx, t)
            last = i == len(passes) - 1
            sync = contextlib.nullcontext() if last else self.acc.no_sync(self.model)
            with sync, self.acc.autocast():
                loss, stats = self.objective(ctx, batch)
            if _any_process(self.acc, not bool(torch.isfinite(loss))):
                bad = True
            if not bad:
                self.acc.backward(loss / len(passes))
            for k, v in stats.items():
                totals[k].append(float(v))
        grad_norm = None
        if not bad and self.cfg.optim.max_grad_norm > 0:
            grad_norm = self.acc.clip_grad_norm_(self.policy.trainable_parameters(), self.cfg.optim.max_grad_norm)
            bad = _any_process(self.acc, not bool(torch.isfinite(grad_norm)))
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
            self.counters.skipped_nonfinite_loss += 1
            return
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.counters.optimizer_steps += 1
        if self.ema is not None:
            self.ema.update()
        if grad_norm is not None:
            totals["grad_norm"].append(float(grad_norm))

    def _step_batch(self, traj, cond, advantages, keep, idx, t) -> StepBatch:
        device = self.acc.device
        ix = torch.as_tensor(idx)
        sigmas = traj.sigmas.to(device)
        return StepBatch(
            x_t=traj.latents[ix, t].to(device), x_next=traj.latents[ix, t + 1].to(device),
            sigma=sigmas[t], sigma_next=sigmas[t + 1], sigma_1=float(traj.sigmas[1]) if len(traj.sigmas) > 1 else None,
            kind=traj.step_kinds[t], old_log_prob=traj.log_probs[ix, t].to(device),
            advantages=advantages[ix].to(device), cond=cond.select(idx), weights=keep[ix].float().to(device),
        )
