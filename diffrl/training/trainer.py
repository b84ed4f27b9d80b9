"""The training loop. Each stage is a call into a package:

    plan (data) -> rollout (sampling strategy) -> rewards -> advantages (algorithms)
    -> update (objective) -> log / eval / checkpoint

Runs under accelerate (CPU, one GPU, DDP, FSDP via accelerate's config).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, pad_across_processes
from tqdm.auto import tqdm

from diffrl.algorithms import compute_advantages, get_objective
from diffrl.algorithms.prompt_history import PromptHistory
from diffrl.algorithms.tree_credit import tree_credit
from diffrl.config import Config, save_config
from diffrl.evaluation.scoring import evaluate_run
from diffrl.evaluation.summary import before_after, read_metrics
from diffrl.inference import checkpoints
from diffrl.inference.session import Session
from diffrl.precision.plan import PrecisionPlan
from diffrl.runtime.clock import StageClock
from diffrl.runtime.compile import compiled
from diffrl.runtime.sharding import max_over_processes, reshard, shard_frozen_copy
from diffrl.sampling import SamplerSettings, get_strategy
from diffrl.training import checkpoint as ckpt
from diffrl.training import run_dir as run_dir_guard
from diffrl.training.console import closing_lines, eval_line, progress_fields, say
from diffrl.training.data import plan_step
from diffrl.training.ema import EMA, OldPolicy
from diffrl.training.guard import Guard, Verdict, carry_out
from diffrl.training.metrics import MetricsLogger
from diffrl.training.plan import derive, format_plan
from diffrl.training.refiner_update import RefinerUpdater
from diffrl.training.replay_watch import ReplayGapWatch, replay_notes
from diffrl.training.rollouts import RolloutParts, rollout_stage
from diffrl.training.setup import avoid_cudnn_attention, make_accelerator, make_lr_scheduler
from diffrl.training.stages import Credit, Rollout
from diffrl.training.tracking import init_trackers, log_evaluation_media
from diffrl.training.update import UpdateCounters, Updater, UpdateSettings
from diffrl.training.watchdog import watch_updates


class Trainer:
    def __init__(self, cfg: Config, accelerator: Accelerator | None = None):
        self.cfg = cfg
        self.acc = accelerator or make_accelerator(cfg)
        avoid_cudnn_attention(self.acc.print)
        self.strategy = get_strategy(cfg.rollout.strategy)
        self.sampler_settings = SamplerSettings.of(cfg)  # all a rollout strategy reads
        self.objective = get_objective(cfg.objective.name)
        self.numbers = derive(cfg, self.acc.num_processes)
        self._build_policy(cfg)
        self._build_update_state(cfg)
        self.guard = Guard(cfg)  # the gold panel's and monitors' rules (guard.*)
        self.step = 0

    def _build_policy(self, cfg: Config) -> None:
        """The inference session (prompts, rewards, the policy), then what training adds:
        the precision plan, the rollout handle, the optimizer and schedule."""
        # Under FSDP the transformer stays in host memory until prepare: fully_shard moves
        # it to the device one block at a time, as shards, and accelerate upcasts the
        # trainable shards; the frozen modules and the rewards follow after prepare, so
        # they are not on the device while it shards. Otherwise everything moves now.
        fsdp = self.acc.distributed_type == DistributedType.FSDP
        evaluating = bool(cfg.eval.every or cfg.eval.at_start)
        # the prompts and rewards first: a bad file or reward fails before any model is built
        prompts = ("train", "eval") if evaluating else ("train",)
        self.session = Session(cfg, self.acc, prompts=prompts, keep_on_host=fsdp)
        self.adapter, self.policy, self.reward_fn = (
            self.session.adapter,
            self.session.policy,
            self.session.reward_fn,
        )
        self.refiner = self.session.refiner  # PromptRL's prompt refiner, or None
        # the FP8 flow patches the policy's layers in place (before compilation, so that the
        # compiled blocks trace the patched forwards); Sol-RL's exploration copy is made from
        # the whole, unsharded weights (before prepare)
        self.precision = PrecisionPlan(cfg, log=self.acc.print)
        self.precision.convert(
            self.adapter.transformer,
            self.reward_fn,
            self.policy.frozen_reference,
            align_forwards=(lambda counts: max_over_processes(self.acc, counts)) if fsdp else None,
            device=self.acc.device if fsdp else None,  # the transformer is still in host memory
        )
        # by block (the default scope), in place (diffrl.runtime.regional)
        self.rollout_model = compiled(self.adapter.transformer, cfg.perf, log=self.acc.print)
        opt = torch.optim.AdamW(
            self.policy.trainable_parameters(),
            lr=cfg.optim.lr,
            betas=tuple(cfg.optim.betas),
            weight_decay=cfg.optim.weight_decay,
            eps=cfg.optim.eps,
        )
        self.model, self.optimizer = self.acc.prepare(self.adapter.transformer, opt)
        if fsdp:
            if self.policy.frozen_reference is not None:  # full fine-tuning's KL reference
                shard_frozen_copy(self.policy.frozen_reference)  # from host memory, block by block
            self.adapter.frozen_to(self.acc.device)
            self.session.rewards_to(self.acc.device)
            self.acc.print(f"FSDP: the transformer is sharded over {self.acc.num_processes} processes")
        # Not passed through prepare(): accelerate would step it once per *process* per
        # optimizer step, while our step counts are already per optimizer step.
        self.scheduler = make_lr_scheduler(self.optimizer, cfg, int(self.numbers["optimizer_steps_total"]))

    def _build_update_state(self, cfg: Config) -> None:
        """Counters, EMAs and the update stage; every piece of state a checkpoint holds is
        registered here, in the order :data:`~diffrl.inference.checkpoints.REGISTERED` gives
        (accelerate names their files by position; readers find the EMA by it)."""
        self.counters = UpdateCounters()
        t = cfg.train
        self.ema = (
            EMA(
                self.policy.trainable_parameters(),
                t.ema_decay,
                t.ema_warmup,
                t.ema_update_every,
                t.ema_repeats,
            )
            if t.ema_decay > 0
            else None
        )
        self.old_policy = None
        if self.objective.needs_old_policy:
            a = cfg.objective.args  # the objective's OldPolicyArgs
            self.old_policy = OldPolicy(
                self.policy.trainable_parameters(), a.old_decay_flat, a.old_decay_rate, a.old_decay_max
            )
        a = cfg.advantage
        history = a.estimator == "prompt_history"  # DDPO's per-prompt statistics, checkpointed
        self.prompt_history = PromptHistory(a.history_size, a.history_min_count, a.eps) if history else None
        self.refiner_updater = self._refiner_updater(cfg)
        self._register_checkpoint_state()
        self.updater = Updater(
            self.acc,
            self.policy,
            self.adapter,
            self.model,
            self.optimizer,
            self.scheduler,
            self.objective,
            UpdateSettings.of(cfg),
            self.counters,
            self.ema,
            self.old_policy,
        )
        self.updater.after_step.append(self.precision.after_optimizer_step)
        parts = RolloutParts(
            self.acc,
            self.adapter,
            self.rollout_model,
            self.model,
            self.reward_fn,
            self.session.train_prompts,
            cfg.seed,
            cfg.rollout.prompts_per_step,
            cfg.rollout.group_size,
            self.refiner,
            cfg.refiner,
        )
        # DiffusionNFT's reference samples with its old (EMA) policy: objective.args.sample_with old
        old = self.old_policy.swapped_in if self.samples_with_old_policy() else None
        self.rollouts = rollout_stage(parts, self.precision, self.strategy, self.sampler_settings, old)

    def _refiner_updater(self, cfg: Config) -> RefinerUpdater | None:
        """PromptRL's LM step (``refiner.train``), or None."""
        if self.refiner is None or not cfg.refiner.train:
            return None
        return RefinerUpdater(
            self.acc, self.refiner, cfg.refiner, cfg.train.micro_batch_size, cfg.optim.max_grad_norm
        )

    def _register_checkpoint_state(self) -> None:
        """Every piece of state a checkpoint holds, registered with accelerate in the order
        :data:`~diffrl.inference.checkpoints.REGISTERED` gives (accelerate names their
        files by position; readers find the EMA by it)."""
        state = {"scheduler": self.scheduler, "counters": self.counters, "ema": self.ema}
        state["old_policy"], state["prompt_history"] = self.old_policy, self.prompt_history
        state["refiner"] = self.refiner_updater
        present = (
            self.ema is not None,
            self.old_policy is not None,
            self.prompt_history is not None,
            self.refiner_updater is not None,
        )
        for name in checkpoints.registered(*present):
            self.acc.register_for_checkpointing(state[name])
        ckpt.install_accelerate_hooks(self.acc)

    # -- stages ---------------------------------------------------------------------------
    def rollout_and_score(self, step: int) -> Rollout:
        """Rollouts of this process's share of the iteration, scored (:mod:`diffrl.training.rollouts`:
        Sol-RL returns the regenerated BF16 subset; everything downstream sees only that)."""
        return self.rollouts(step)

    def samples_with_old_policy(self) -> bool:
        """DiffusionNFT's ``objective.args.sample_with: old``: roll out with the old policy."""
        sample_with = getattr(self.cfg.objective.args, "sample_with", "current")
        return self.old_policy is not None and sample_with == "old"

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate ``t`` over processes along dim 0; lengths may differ (Sol-RL
        sub-trees have data-dependent node counts), so blocks are padded, gathered and cut."""
        t = t.to(self.acc.device)
        if self.acc.num_processes == 1:
            return t.cpu()
        sizes = self.acc.gather(torch.tensor([t.shape[0]], device=self.acc.device)).cpu().tolist()
        padded = self.acc.gather(pad_across_processes(t, dim=0)).cpu()
        width = max(sizes)
        return torch.cat([padded[i * width : i * width + n] for i, n in enumerate(sizes)])

    def credit(self, r: Rollout, step: int) -> Credit:
        """Advantages over the whole batch: per group for independent samples, per (tree,
        depth) with pruning for trees."""
        return self.tree_advantages(r, step) if r.is_tree else self.advantages(r, step)

    def advantages(self, r: Rollout, step: int) -> Credit:
        """Gather rewards and group ids from every process and normalise over whole groups
        (or by each prompt's reward history: DDPO's and RLCM's ``prompt_history``)."""
        all_total, all_groups = self.gather(r.total), self.gather(r.groups)
        a = self.cfg.advantage
        if self.prompt_history is not None:
            return self._history_advantages(all_total, all_groups, step, len(r.total))
        adv = compute_advantages(
            all_total,
            all_groups,
            a.estimator,
            a.eps,
            a.filter_zero_std,
            self.gather(r.components),
            self.reward_fn.weights,
            a.std,
        )
        n, rank = len(r.total), self.acc.process_index
        sl = slice(rank * n, (rank + 1) * n)
        values, keep, refill = adv.values[sl], adv.keep[sl], None
        if a.drop_zero:  # flow_grpo: a zero advantage leaves the update, a few may come back
            zero = values == 0
            refill, keep = zero & adv.clean[sl], keep & ~zero
        return Credit(all_total, values, keep, adv.filtered_fraction, adv.dropped_groups, refill=refill)

    def _history_advantages(self, all_total, all_groups, step: int, n: int) -> Credit:
        """Advantages against each prompt's reward history, kept identical on every
        process (each updates its copy with the same gathered rewards)."""
        cfg = self.cfg
        plan = plan_step(self.session.train_prompts, cfg.seed, step, cfg.rollout.prompts_per_step, 1)
        prompts = [plan.prompts[int(g)] for g in all_groups.tolist()]
        values, finite = self.prompt_history.advantages(prompts, all_total)
        rank = self.acc.process_index
        sl = slice(rank * n, (rank + 1) * n)
        dropped = len(torch.unique(all_groups[~finite]))  # groups with a non-finite reward
        return Credit(all_total, values[sl].float(), finite[sl], 0.0, dropped)

    def tree_advantages(self, r: Rollout, step: int) -> Credit:
        """BranchGRPO credit: fused node rewards, depth-wise advantages, pruning."""
        traj = r.traj
        credit = tree_credit(
            traj,
            r.total,
            r.components,
            self.cfg,
            step,
            self.reward_fn.weights,
            self.gather,
            self.acc.process_index,
        )
        counts = self.gather(torch.tensor([[int(credit.train.sum()), int((traj.depth > 0).sum())]])).sum(0)
        # all processes; edges left after pruning, before objective.timestep_fraction subsamples them
        stats = {"tree/edges_after_pruning": int(counts[0]), "tree/edges": int(counts[1])}
        return Credit(
            self.gather(r.total),
            credit.advantages,
            credit.keep,
            credit.filtered_fraction,
            credit.dropped_groups,
            credit.train,
            stats,
        )

    def across_processes(self, local: dict) -> dict:
        """Per-process metrics over all processes: NFE and sync counts are summed, times
        take the slowest process, the rest (rewards, rank agreement, the objective's loss
        and statistics) the mean. Every process must pass the same keys (a collective)."""
        if self.acc.num_processes == 1:
            return dict(local)
        keys = sorted(local)
        values = self.gather(torch.tensor([[float(local[k]) for k in keys]], dtype=torch.float64))
        out = {}
        for i, k in enumerate(keys):
            col = values[:, i]
            if k.endswith(("_nfe", "/syncs")):
                out[k] = float(col.sum())
            elif k.startswith(("time/", "memory/")):
                out[k] = float(col.max())
            else:
                out[k] = float(col.nanmean())
        return out

    def leaf_view(self, r: Rollout) -> Rollout:
        """A tree's leaves as independent samples grouped by tree: what a forward-process
        objective (NFT) trains on, since it needs only clean samples and their group."""
        traj = r.traj
        trees = traj.tree[traj.leaf_nodes()].cpu()
        cond = r.cond.select([traj.cond_rows[t] for t in trees.tolist()])
        groups = trees + self.acc.process_index * traj.num_trees
        return dataclasses.replace(r, traj=traj.path_trajectory(), cond=cond, groups=groups)

    def train_step(self, step: int) -> dict:
        r = self.rollout_and_score(step)
        if r.is_tree and self.objective.forward_process:
            r = self.leaf_view(r)
        credit = self.credit(r, step)
        all_total, dropped = credit.all_rewards, credit.dropped_groups
        extra = {**self.across_processes(r.stage_metrics), **credit.stats}
        nfe = int(self.gather(torch.tensor([r.nfe])).sum())  # all processes
        finite = all_total[torch.isfinite(all_total)]
        none = torch.tensor(float("nan"))  # logged as null: no finite reward this iteration
        metrics = {
            "reward/mean": finite.mean() if len(finite) else none,
            "reward/std": finite.std(unbiased=False) if len(finite) else none,
            "reward/nonfinite_samples": len(all_total) - len(finite),
            "advantage/dropped_groups": dropped,
            "advantage/filtered_fraction": credit.filtered_fraction,
            "rollout/nfe": nfe,
            "rollout/nfe_per_leaf": nfe / len(all_total),
            **extra,
        }
        for name, values in r.logs.items():
            values = self.gather(values)
            if not bool(torch.isnan(values).all()):  # NaN: the score does not apply to that sample
                metrics[f"reward/{name}/mean"] = values.nanmean()
        # groups with a non-finite reward were dropped (advantages); train on the rest,
        # unless nothing is left
        if dropped and not bool(self.gather(credit.keep.float()).sum() > 0):
            self.counters.skipped_nonfinite_reward += 1
        else:
            clock = StageClock(self.acc.device)
            if self.cfg.refiner.train_flow:
                with clock.stage("update"):
                    # every process runs the same passes, so the same statistics' keys
                    with self.precision.phase("train"):
                        update_metrics = self.updater.run(r.traj, r.cond, credit, step)
                    metrics.update(self.across_processes(update_metrics))
            if self.refiner_updater is not None:  # PromptRL: the LM from the same advantages
                with clock.stage("refiner_update"):
                    lm_metrics = self.refiner_updater.run(r.rewrites, credit.advantages, credit.keep)
                    metrics.update(self.across_processes(lm_metrics))
            metrics.update(self.across_processes(clock.metrics))
        if self.old_policy is not None:
            # DiffusionNFT's schedule is a function of the optimizer steps completed so far
            # (its global_step after this epoch's update), not of the iteration index
            self.old_policy.refresh(self.counters.optimizer_steps)
        metrics.update(
            {
                "skipped/nonfinite_loss": self.counters.skipped_nonfinite_loss,
                "skipped/fp16_overflow": self.counters.skipped_fp16_overflow,
                "skipped/nonfinite_reward": self.counters.skipped_nonfinite_reward,
                "optimizer_steps": self.counters.optimizer_steps,
                "lr": self.scheduler.get_last_lr()[0],
            }
        )
        return metrics

    def evaluate(self) -> dict:
        """Held-out prompts (``eval/``) and, if configured, the training subset
        (``eval_train/``), scored with the EMA weights when the run keeps an EMA."""
        ctx = self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()
        with ctx:
            sheets = self.cfg.run_dir / "samples"
            if self.acc.is_main_process:
                sheets.mkdir(parents=True, exist_ok=True)
            media = {}
            sheet = sheets / f"step-{self.step}.png"
            out = evaluate_run(self.session, sheet_path=sheet, media=media, watch=self.guard.watch)
            log_evaluation_media(self.acc, self.step, media)
        reshard(self.model)  # FSDP: drop the EMA weights the evaluation's forwards gathered
        if self.acc.is_main_process:
            self.guard.save_reference(self.cfg.run_dir)
        return out

    # -- loop -----------------------------------------------------------------------------
    def resume(self, spec: str) -> None:
        path = checkpoints.resolve_resume(spec, self.cfg.run_dir, log=self.acc.print)
        self.step = ckpt.load_checkpoint(self.acc, self.policy, path, self.cfg.model, self.cfg)
        self.acc.print(f"resumed from {path} at step {self.step}")

    def fit(self) -> list[dict]:
        cfg = self.cfg
        run_dir = cfg.run_dir
        gap_watch = self._open_run(run_dir)
        logger = MetricsLogger(self.acc, run_dir, resume_step=self.step)
        logged = run_dir / "metrics.jsonl"
        if self.step > 0 and logged.is_file():  # the guard's first evaluation, best and alarms, as they were
            self.guard.replay(read_metrics(logged), run_dir)
        history = []
        if cfg.eval.at_start and self.step == 0:
            self._act_on(self._logged(logger, history, self.evaluate(), evaluated=True))
        bar = tqdm(
            total=cfg.train.max_steps,
            initial=self.step,
            disable=not (cfg.logging.progress_bar and self.acc.is_local_main_process),
            desc="train",
        )
        while self.step < cfg.train.max_steps:
            c = self.counters
            before = (c.optimizer_steps, c.skipped_nonfinite_loss, c.skipped_fp16_overflow)
            metrics = self.train_step(self.step)
            self.step += 1
            limit = cfg.train.max_skipped_iterations
            watch_updates(self.acc, self.counters, self.step, metrics, before, limit, run_dir)
            gap_watch.check(self.step, metrics)
            last = self.step == cfg.train.max_steps
            evaluated = cfg.eval.every and (self.step % cfg.eval.every == 0 or last)
            if evaluated:
                metrics.update(self.evaluate())
            verdict = self._logged(logger, history, metrics, evaluated)
            bar.update(1)
            bar.set_postfix(progress_fields(history[-1]))
            saved = last or bool(cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0)
            if saved:
                self._save()
            if verdict is not None and self._act_on(verdict, saved):
                break
        bar.close()
        self._close(run_dir)
        return history

    def _open_run(self, run_dir) -> ReplayGapWatch:
        """The run directory, its config, trackers and plan; the replay-gap watch."""
        if self.step == 0:  # a fresh start (not a resume) never mixes with an earlier run
            run_dir_guard.ensure_fresh(run_dir)
            self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, run_dir / "config.yaml")
        init_trackers(self.acc, self.cfg)
        self.acc.print(format_plan(self.numbers))
        notes = replay_notes(self.cfg)
        for note in notes:
            self.acc.print(f"note: {note}")
        return ReplayGapWatch(
            self.cfg.train.replay_gap_warn, self.cfg.objective.clip_range, notes, lambda m: say(self.acc, m)
        )

    def _logged(self, logger, history: list, metrics: dict, evaluated) -> Verdict | None:
        """Log this step's row (and its evaluation line); the guard's verdict on it."""
        verdict = self.guard.check(self.step, metrics) if evaluated else None
        history.append(logger.log(self.step, metrics))
        if evaluated:
            say(self.acc, eval_line(self.step, history[-1], self.headline_metrics()))
        return verdict

    def _close(self, run_dir) -> None:
        """The before/after table, where everything is, and the guard's best and alarms."""
        self.acc.wait_for_everyone()
        self.acc.print(before_after(run_dir / "metrics.jsonl", self.headline_metrics()))
        latest = checkpoints.latest_complete(run_dir)
        self.acc.print(closing_lines(run_dir, latest[1] if latest else None, self.cfg.train.ema_decay))
        for line in self.guard.summary(run_dir):
            self.acc.print(line)
        self.acc.end_training()

    def _save(self):
        cfg = self.cfg
        return ckpt.save_checkpoint(
            self.acc, self.policy, cfg, self.step, cfg.checkpoint.keep, self.ema, self.refiner
        )

    def _act_on(self, verdict: Verdict, saved: bool = False) -> bool:
        """The guard's verdict carried out (:func:`~diffrl.training.guard.carry_out`)."""
        saved_path = checkpoints.checkpoint_root(self.cfg.run_dir) / f"step-{self.step}"
        checkpoint = (lambda: saved_path) if saved else self._save
        return carry_out(verdict, self.step, self.acc, self.cfg.run_dir, checkpoint)

    def headline_metrics(self) -> tuple[str, ...]:
        """Listed first in the summary: a verifier's strict score (``<reward>_strict``, as
        ShapeWorld logs) if there is one, else the first reward."""
        first = self.cfg.rewards[0].key
        return (f"eval/{first}_strict/mean", f"eval/{first}/mean")
