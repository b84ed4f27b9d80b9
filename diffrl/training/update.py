"""The policy-update stage: replay stored trajectories through the objective.

For each inner epoch, :mod:`diffrl.training.passes` lays the iteration's transitions out into
forward passes and optimizer steps (keyed by seed and step, so a resumed run shuffles
identically): micro-batches of samples for independent trajectories, per-step batches of
edges for trees.

A non-finite loss or gradient norm on any process skips that optimizer step on every
process (the gradient is discarded and the skip is counted), so a blow-up is never
applied.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType

from diffrl.algorithms.anchor import anchor_loss
from diffrl.algorithms.objective import LossContext, StepBatch
from diffrl.runtime.regional import eager_blocks
from diffrl.runtime.sharding import max_over_processes, mean_over_processes, reshard, whole
from diffrl.sampling import rng
from diffrl.training.passes import (
    Pass,
    PassSettings,
    add_tree_anchors,
    edge_major,
    sample_major,
    step_edge_counts,
    tree_anchor_counts,
)


@dataclass(frozen=True)
class UpdateSettings:
    """What the update stage reads from the configuration, and nothing else."""

    passes: PassSettings
    objective: object  # diffrl.config.ObjectiveConfig: the loss's own hyper-parameters
    noise_level: float  # sampling.noise_level: the SDE the stored log-probs came from
    num_inner_epochs: int  # train.num_inner_epochs
    max_grad_norm: float  # optim.max_grad_norm (0: no clipping)

    @classmethod
    def of(cls, cfg) -> UpdateSettings:
        """``cfg`` narrowed to the update settings (an UpdateSettings passes through)."""
        if isinstance(cfg, cls):
            return cfg
        return cls(
            PassSettings.of(cfg),
            cfg.objective,
            cfg.sampling.noise_level,
            cfg.train.num_inner_epochs,
            cfg.optim.max_grad_norm,
        )


@dataclass
class UpdateCounters:
    """Persistent counters (checkpointed through accelerate's registered objects)."""

    optimizer_steps: int = 0
    skipped_nonfinite_loss: int = 0
    skipped_nonfinite_reward: int = 0
    skipped_fp16_overflow: int = 0  # steps the fp16 gradient scaler skipped (it lowers its scale)
    iterations_without_update: int = 0  # in a row, up to the last iteration (diffrl.training.watchdog)

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


def _prompt_groups(traj, rows) -> torch.Tensor:
    """Per row, a number shared by the rows of one prompt group: a tree's index for tree
    nodes, else the sample key without its sample index (seed, iteration, prompt)."""
    if hasattr(traj, "tree"):
        return traj.tree[torch.as_tensor(rows)].long()
    ids: dict[tuple, int] = {}
    return torch.tensor([ids.setdefault(tuple(traj.keys[i][:-1]), len(ids)) for i in rows])


def _any_process(accelerator, flag) -> bool:
    """Whether ``flag`` (a bool, or a bool tensor on the device) is true on any process:
    one collective and one host read."""
    t = torch.as_tensor(flag, device=accelerator.device).float().reshape(1)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)


def _any_process_each(accelerator, *flags) -> list[bool]:
    """For each flag (a bool tensor on the device), whether it is true on any process: one
    collective and one host read for all of them."""
    t = torch.stack([torch.as_tensor(f, device=accelerator.device).float().reshape(()) for f in flags])
    return [bool(v > 0) for v in accelerator.reduce(t, reduction="sum").tolist()]


def _means(totals: dict[str, list], device) -> dict[str, float]:
    """The mean of each statistic, read to the host once: the per-pass statistics stay on
    the device until here (a ``float()`` per statistic per pass was a device sync each)."""
    if not totals:
        return {}
    means = [
        torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in vals]).mean()
        for vals in totals.values()
    ]
    return dict(zip(totals, torch.stack(means).tolist()))


class Updater:
    """Runs the objective over a trajectory and steps the optimizer."""

    def __init__(
        self,
        accelerator,
        policy,
        adapter,
        model,
        optimizer,
        scheduler,
        objective,
        settings,
        counters: UpdateCounters,
        ema=None,
        old_policy=None,
    ):
        self.acc, self.policy, self.adapter, self.model = accelerator, policy, adapter, model
        self.optimizer, self.scheduler, self.objective = optimizer, scheduler, objective
        self.settings = UpdateSettings.of(settings)
        self.counters, self.ema, self.old_policy = counters, ema, old_policy
        self.forward_process = objective.forward_process
        self.whole_groups = objective.whole_groups  # passes of whole groups, one noise per group
        self.fsdp = getattr(accelerator, "distributed_type", None) == DistributedType.FSDP
        self._steps_at_start = 0  # optimizer steps applied before this run() (replay gap)
        self.after_step: list = []  # called after every applied optimizer step (Sol-RL marks its copy stale)

    def loss_context(self) -> LossContext:
        guidance = self.settings.objective.train_cfg
        detach_uncond = self.settings.objective.detach_uncond  # flow_grpo's compute_log_prob

        def policy_velocity(x, sigma, cond):
            return self.adapter.velocity(
                self.model, x, sigma, cond, guidance=guidance, detach_uncond=detach_uncond
            )

        def reference_velocity(x, sigma, cond):
            with self.policy.reference() as ref:
                return self.adapter.velocity(ref, x, sigma, cond, guidance=guidance)

        old_velocity = None
        if self.old_policy is not None:

            def old_velocity(x, sigma, cond):
                # swaps the old weights into the live parameters: call before the policy
                # forward whose graph is kept, never between it and backward
                with torch.no_grad(), self.old_policy.swapped_in():
                    v = self.adapter.velocity(self.model, x, sigma, cond, guidance=guidance)
                reshard(self.model)  # FSDP: drop the old weights gathered by this forward
                return v

        return LossContext(
            policy_velocity,
            reference_velocity,
            self.settings.objective,
            self.settings.noise_level,
            old_velocity,
        )

    def run(self, traj, cond, credit, step: int) -> dict[str, float]:
        """Update on ``traj`` with ``credit`` (a :class:`~diffrl.training.stages.Credit`).
        Independent trajectories index its advantages and ``keep`` by sample; trees index
        them by node, and ``credit.edges`` says which edges to backpropagate. The passes
        carry ``credit.keep`` as their per-row ``counted`` mask."""
        s = self.settings
        ctx = self.loss_context()
        advantages, keep, train = credit.advantages, credit.keep, credit.edges
        if train is None:
            plan = self._sample_plan(traj, keep, step, credit.refill)
        else:
            if s.objective.skip_last_step:  # the edges into the last depth are the last step's
                train = train & (traj.depth.to(train.device) != traj.num_steps)
            # everything pruned on every process: nothing to update. Asked of all processes
            # (a collective): one with no edges of its own still runs the padded passes
            if not _any_process(self.acc, bool(train.any())):
                return {}
            plan = self._tree_plan(traj, train, keep, step)

        totals: dict[str, list] = defaultdict(list)
        self._steps_at_start = self.counters.optimizer_steps
        # every forward of the update on one code path: the compiled rollout blocks are
        # for the rollouts; the KL reference and the old policy run eagerly too
        with eager_blocks():
            for epoch in range(s.num_inner_epochs):
                for passes in plan(epoch):
                    self._optimizer_step(ctx, traj, cond, advantages, passes, totals, epoch)
        return _means(totals, self.acc.device)

    def _sample_plan(self, traj, keep, step: int, refill=None):
        """The per-epoch pass plan of independent trajectories (:func:`sample_major`;
        ``refill``: advantage.drop_zero's layout, :func:`~diffrl.training.passes.dropped_layout`)."""
        s = self.settings
        # a forward-process objective (NFT) noises x0 afresh: every step's sigma is usable
        trainable = self._forward_steps(traj) if self.forward_process else traj.trainable_steps()
        if s.objective.skip_last_step:  # DanceGRPO's ignore_last: sampled, never trained
            trainable = [t for t in trainable if t != traj.num_steps - 1]
        if not trainable:
            raise ValueError(
                "no trainable denoising steps: sampling.sde_type is 'ode' or the SDE window is empty"
            )
        anchored = (
            [t for t in range(traj.num_steps) if t not in trainable] if s.objective.anchor_coef > 0 else []
        )

        whole = _prompt_groups(traj, range(len(traj.keys))) if self.whole_groups else None

        def plan(epoch):
            return sample_major(
                len(traj.keys), trainable, s.passes, step, epoch, anchored, keep, whole, refill
            )

        return plan

    def _tree_plan(self, traj, train, keep, step: int):
        """The per-epoch pass plan of trees: :func:`edge_major` over the trained edges, and
        with the anchor, :func:`add_tree_anchors` on the ODE steps (the steps no edge
        trains). A tree none of whose nodes counts (dropped for a non-finite reward, or
        filtered for zero variance) is not anchored, as such samples are not when
        independent."""
        s = self.settings
        pad_to = self._common_edge_counts(train, traj)
        several = self.acc.num_processes > 1
        mean = (lambda counts: mean_over_processes(self.acc, counts)) if several else None
        ode_steps = [t for t, k in enumerate(traj.step_kinds) if k == "ode"]
        anchored = ode_steps if s.objective.anchor_coef > 0 else []
        if anchored:
            anchor_pad = self._common_anchor_counts(traj, anchored)
            tree = traj.tree.cpu()
            kept_trees = torch.zeros(traj.num_trees, dtype=torch.bool)
            kept_trees[tree[keep.cpu().bool()]] = True
            anchor_keep = kept_trees[tree]

        def plan(epoch):
            groups = edge_major(train, traj.depth, traj.num_leaves, s.passes, step, epoch, keep, pad_to, mean)
            if anchored:
                groups = add_tree_anchors(
                    groups, traj.depth, anchored, s.passes, step, epoch, anchor_keep, anchor_pad
                )
            return groups

        return plan

    def _forward_steps(self, traj) -> list[int]:
        """A clean-sample objective may noise x0 to any step's sigma; ``objective.
        forward_window`` [start, end) narrows them (DGPO trains the high-noise steps)."""
        window = self.settings.objective.forward_window
        start, end = window if window else (0, traj.num_steps)
        return list(range(start, min(end, traj.num_steps)))

    def _common_edge_counts(self, train, traj) -> dict[int, int] | None:
        """Per-step edge counts, the maximum over processes: trees of different shapes
        (Sol-RL sub-trees) would otherwise give processes different passes, and every
        pass runs collectives. None on one process."""
        return self._max_per_step(traj, lambda: step_edge_counts(train, traj.depth, self.settings.passes))

    def _common_anchor_counts(self, traj, anchored) -> dict[int, int] | None:
        """Per-step anchor rows, the maximum over processes (as :meth:`_common_edge_counts`:
        sub-trees differ in node counts). None on one process."""
        passes = self.settings.passes
        return self._max_per_step(traj, lambda: tree_anchor_counts(traj.depth, anchored, passes))

    def _max_per_step(self, traj, local_counts) -> dict[int, int] | None:
        """``local_counts()`` (step -> count on this process), the maximum over processes
        of each step's count, steps with none left out. None on one process (nothing to agree)."""
        if self.acc.num_processes == 1:
            return None
        local = [0] * traj.num_steps
        for t, n in local_counts().items():
            local[t] = n
        return {t: n for t, n in enumerate(max_over_processes(self.acc, local)) if n > 0}

    def _optimizer_step(self, ctx, traj, cond, advantages, passes: list[Pass], totals, epoch: int) -> None:
        """Accumulate gradients over ``passes``, then step once."""
        # Every process runs the same passes (passes.py guarantees it), so the gradient
        # all-reduce of DDP happens once, on the last pass: no_sync skips it on the others.
        # Under FSDP every pass reduce-scatters instead: FSDP2's no_sync keeps whole
        # (unsharded) gradients on every process until the last pass.
        # Whether a loss was non-finite stays on the device until the step: the passes all
        # run their backward, and one check before the optimizer step (a collective, so
        # every process agrees) discards the whole gradient if any loss or the gradient norm
        # was non-finite. One host read per optimizer step instead of one per pass.
        bad_loss = torch.zeros((), dtype=torch.bool, device=self.acc.device)
        bad_grad = torch.zeros((), dtype=torch.bool, device=self.acc.device)
        for i, p in enumerate(passes):
            batch = self._step_batch(traj, cond, advantages, p)
            if self.forward_process and not p.anchor:
                batch = self._forward_noised(batch, traj, p, epoch)
            last = i == len(passes) - 1
            sync = contextlib.nullcontext() if last or self.fsdp else self.acc.no_sync(self.model)
            with sync, self.acc.autocast():
                loss, stats = (anchor_loss if p.anchor else self.objective)(ctx, batch)
                bad_loss = bad_loss | ~torch.isfinite(whole(loss)).to(bad_loss.device)
                num, den = p.share
                # num == 1: divide only, as before shares existed (keeps old runs bitwise equal)
                self.acc.backward(loss * num / den if num != 1 else loss / den)
            for k, v in stats.items():
                totals[k].append(v.detach() if torch.is_tensor(v) else float(v))
            self._record_replay_gap(totals, stats, p)
        grad_norm = None
        max_norm = self.settings.max_grad_norm
        if max_norm > 0:
            grad_norm = self.acc.clip_grad_norm_(self.policy.trainable_parameters(), max_norm)
            grad_norm = whole(grad_norm)  # under FSDP a replicated DTensor: its local value
            bad_grad = bad_grad | ~torch.isfinite(grad_norm).to(bad_grad.device)
        # discard the gradient: a blow-up is never applied, only counted
        any_bad_loss, any_bad_grad = _any_process_each(self.acc, bad_loss, bad_grad)
        if any_bad_loss or any_bad_grad:
            self._skip_step(overflow_only=not any_bad_loss)
            return
        # the scheduler is stepped here, once per optimizer step, rather than by accelerate
        # (which would step it once per process); the EMA and Sol-RL's stale mark follow
        # every applied step, never a skipped one
        self.optimizer.step()
        if getattr(self.optimizer, "step_was_skipped", False):  # fp16 scaler, no clipping to see it
            self.optimizer.zero_grad(set_to_none=True)
            self.counters.skipped_fp16_overflow += 1
            return
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.counters.optimizer_steps += 1
        if self.ema is not None:
            self.ema.update()
        for hook in self.after_step:
            hook()
        if grad_norm is not None:
            totals["grad_norm"].append(grad_norm)

    def _record_replay_gap(self, totals, stats, p: Pass) -> None:
        """|log-prob of the training forward - log-prob stored at sampling|, per denoising
        step, while the weights are still those that sampled (no step applied yet this
        iteration): 0 to float tolerance for an on-policy run, the rollout/training
        mismatch otherwise (FP8 rollouts under a BF16 update: docs/ALGORITHMS.md)."""
        if "log_ratio_abs" not in stats or self.counters.optimizer_steps != self._steps_at_start:
            return
        gap = stats["log_ratio_abs"].detach()
        totals["replay/logprob_gap"].append(gap)
        totals[f"replay/logprob_gap/step{p.t:02d}"].append(gap)

    def _skip_step(self, overflow_only: bool) -> None:
        """Discard this step's gradient. Under fp16 a gradient scaler is at work (accelerate
        makes one for ``train.mixed_precision: fp16`` on CUDA). A gradient that overflowed
        while every loss was finite is then the scaler's normal, self-correcting event:
        the scale is lowered by its backoff factor, as its own ``step`` would on an inf,
        and the skip is counted apart (``skipped/fp16_overflow``), never held against the
        run. The scale is set here rather than left to the scaler's ``step``, which would
        apply a gradient whose norm overflowed while each element stayed finite. A
        non-finite loss is counted as one (``skipped/nonfinite_loss``), scaler or not."""
        scaler = getattr(self.acc, "scaler", None)
        if scaler is not None:
            factor = scaler.get_backoff_factor() if overflow_only else 1.0
            scaler.update(scaler.get_scale() * factor)  # also forgets this step's unscale
        if scaler is not None and overflow_only:
            self.counters.skipped_fp16_overflow += 1
        else:
            self.counters.skipped_nonfinite_loss += 1
        self.optimizer.zero_grad(set_to_none=True)

    def _step_batch(self, traj, cond, advantages, p: Pass) -> StepBatch:
        device, t = self.acc.device, p.t
        x_t, x_next, old_log_prob, cond_rows = traj.transition(p.rows, t)
        ix = torch.as_tensor(p.rows)
        sigmas = traj.sigmas.to(device)
        return StepBatch(
            x_t=x_t.to(device),
            x_next=x_next.to(device),
            sigma=sigmas[t],
            sigma_next=sigmas[t + 1],
            sigma_1=self._sigma_1(traj),
            kind=traj.step_kinds[t],
            old_log_prob=old_log_prob.to(device),
            advantages=advantages[ix].to(device),
            cond=cond.select(cond_rows),
            weights=p.row_weights().to(device),
            noise_level=traj.noise_levels[t] if traj.noise_levels else None,
            # only what some objective of this kind reads: transition means for the
            # transition objectives, group ids for the whole-group ones (DGPO)
            old_mean=None if self.forward_process else traj.old_means(p.rows, t).to(device),
            groups=_prompt_groups(traj, p.rows).to(device) if self.whole_groups else None,
        )

    @staticmethod
    def _sigma_1(traj) -> float | None:
        """sigma_1 (the CPS step rule's), read from the CPU copy of the grid."""
        return traj.sigmas[1:2].tolist()[0] if len(traj.sigmas) > 1 else None  # no scalar read

    def _forward_noised(self, batch: StepBatch, traj, p: Pass, epoch: int) -> StepBatch:
        """A clean-sample objective's input: x_t = (1 - sigma_t) x0 + sigma_t eps with fresh
        noise keyed by (sample key, epoch, t), so a resumed run draws the same noise."""
        x0 = traj.latents[torch.as_tensor(p.rows), -1].to(batch.x_t.device)
        keys = [traj.keys[i] for i in p.rows]
        if self.whole_groups:  # one draw per prompt group, shared by its members (DGPO)
            keys = [tuple(k[:-1]) for k in keys]
        eps = rng.randn_batch(x0.shape[1:], keys, "nft", epoch, p.t).to(x0.device)
        sigma = batch.sigma.to(x0.device)
        batch.x0, batch.x_t, batch.forward_noise = x0, (1 - sigma) * x0 + sigma * eps, eps
        return batch
