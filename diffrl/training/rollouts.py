"""The rollout stage of an iteration: this process's share of the iteration's samples,
scored, as a :class:`~diffrl.training.stages.Rollout`. Two kinds, chosen once when the
trainer is built (:func:`rollout_stage`):

* :class:`PlainRollouts`: the configured strategy (independent or tree) samples with the
  policy, inside the precision plan's ``rollout`` phase, then the rewards score it;
* :class:`SolRLRollouts`: Sol-RL's two stages (:class:`~diffrl.precision.solrl.SolRLStage`:
  a low-precision pool, a contrastive subset, its BF16 regeneration); everything
  downstream sees only the regenerated subset.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from diffrl.runtime.clock import StageClock
from diffrl.runtime.sharding import reshard
from diffrl.training.data import plan_step
from diffrl.training.reward_overlap import overlap_hook
from diffrl.training.stages import Rollout


@dataclass
class RolloutParts:
    """What a rollout stage samples with and scores by (the trainer's own handles)."""

    acc: object  # the Accelerator: process layout and autocast
    adapter: object
    rollout_model: object  # the (possibly compiled) policy the rollouts call
    model: object  # the prepared policy (resharded after a rollout under FSDP)
    reward_fn: object
    prompts: list[str]  # the training prompts
    seed: int
    prompts_per_step: int
    group_size: int
    refiner: object = None  # PromptRL's PromptRefiner: rewrites each sample's prompt before rendering
    refiner_settings: object = None  # the refiner section (keep_original, format_reward)


class PlainRollouts:
    """The strategy's rollouts with the policy (or DiffusionNFT's old policy, see
    ``old_weights``), scored."""

    def __init__(self, parts: RolloutParts, strategy, sampler_settings, precision, old_weights=None):
        self.parts, self.strategy, self.sampler_settings = parts, strategy, sampler_settings
        self.precision = precision
        # a factory of the weights to sample with (DiffusionNFT's old policy), or None
        self.old_weights = old_weights

    def __call__(self, step: int) -> Rollout:
        p = self.parts
        plan = plan_step(p.prompts, p.seed, step, p.prompts_per_step, p.group_size)
        _, local = plan.shard(p.acc.process_index, p.acc.num_processes)
        clock = StageClock(p.acc.device)
        rewrites = refine(p, local, clock)
        cond = p.adapter.encode_prompts(
            local.prompts if rewrites is None else rewrites.rendered(local.prompts)
        )
        weights = self.old_weights() if self.old_weights is not None else contextlib.nullcontext()
        overlap, pending = overlap_hook(p.reward_fn, self.strategy, local.prompts)  # remote rewards
        args = (p.adapter, p.rollout_model, cond, local.keys, self.sampler_settings)
        with (
            clock.stage("rollout"),
            torch.no_grad(),
            p.acc.autocast(),
            weights,
            self.precision.phase("rollout"),
        ):
            traj = self.strategy(*args, iteration=step, **overlap)
        reshard(p.model)  # FSDP: the update must gather the live weights, not the rollout's
        with clock.stage("reward"):
            # the images are judged against the prompts as written, whatever was rendered
            total, comps, logs = p.reward_fn(traj.images, local.prompts, {"keys": local.keys}, pending)
        if rewrites is not None:
            total, logs = with_format_reward(total, logs, rewrites, local.group_ids, p.refiner_settings)
        return Rollout(traj, cond, local.group_ids, total, comps, logs, clock.metrics, traj.nfe, rewrites)


class SolRLRollouts:
    """Sol-RL's pool of ``solrl.pool_size`` candidates per prompt, of which the
    regenerated ``group_size`` are the iteration's samples. With ``old_weights``
    (``objective.args.sample_with: old``) both stages sample with the old policy, as Sol-RL's
    ``train_sana.py`` syncs its exploration and regeneration copies from the decayed old
    adapter (meefs/Sana@6926be6 ``train_scripts/sol_rl/train_sana.py:739-740, 1142-1143``)."""

    def __init__(self, parts: RolloutParts, stage, old_weights=None):
        self.parts, self.stage, self.old_weights = parts, stage, old_weights

    def __call__(self, step: int) -> Rollout:
        p = self.parts
        size = self.stage.settings.solrl.pool_size
        plan = plan_step(p.prompts, p.seed, step, p.prompts_per_step, size)
        _, local = plan.shard(p.acc.process_index, p.acc.num_processes)
        cond = p.adapter.encode_prompts(local.prompts)
        weights = contextlib.nullcontext()
        if self.old_weights is not None:
            weights = self.old_weights()
            self.stage.mark_stale()  # the old policy moves at every iteration's end, steps or not
        with weights:  # the exploration copy syncs from, and the regeneration runs, these weights
            out = self.stage.run(
                p.adapter,
                p.adapter.transformer,
                cond,
                local.prompts,
                local.keys,
                step,
                p.acc.autocast,
                rollout_model=p.rollout_model,
            )
        reshard(p.model)  # FSDP: as after any rollout
        groups = local.group_ids.reshape(-1, size)[:, : p.group_size].flatten()
        nfe = out.metrics["solrl/explore_nfe"] + out.metrics["solrl/regenerate_nfe"]
        return Rollout(out.traj, out.cond, groups, out.total, out.components, out.logs, out.metrics, nfe)


def refine(p: RolloutParts, local, clock):
    """PromptRL: the refiner's rewrite of each sample's prompt (None without a refiner); the
    first ``refiner.keep_original`` members of each group keep their prompt."""
    if p.refiner is None:
        return None
    keep = [key[-1] < p.refiner_settings.keep_original for key in local.keys]
    with clock.stage("refine"), torch.no_grad():
        return p.refiner.rewrite(local.prompts, local.keys, keep=keep, group_size=p.group_size)


def with_format_reward(total, logs, rewrites, groups, settings):
    """The reward plus ``refiner.format_reward`` for a rewrite in the template's format
    (UniRL: GenEval's score plus 1 or 0, a plain sum); a kept original gets its group's
    mean format reward, as UniRL's editing runs give theirs (``edit_grpo_trainer.py``), so
    that keeping the prompt is neither paid nor punished for the format."""
    formatted = rewrites.formatted.to(total)
    trained = rewrites.trained.to(total.device)
    bonus = formatted.clone()
    for g in torch.unique(groups).tolist():
        rows = (groups.to(total.device) == g) & trained
        members = groups.to(total.device) == g
        bonus[members & ~trained] = formatted[rows].mean() if bool(rows.any()) else 0.0
    logs = {
        **logs,
        "refiner_format": torch.where(trained, formatted, torch.full_like(formatted, float("nan"))),
    }
    return total + settings.format_reward * bonus, logs


def rollout_stage(parts: RolloutParts, precision, strategy, sampler_settings, old_weights=None):
    """Sol-RL's stage where the precision plan built one, else the plain rollouts."""
    if precision.solrl is not None:
        return SolRLRollouts(parts, precision.solrl, old_weights)
    return PlainRollouts(parts, strategy, sampler_settings, precision, old_weights)
