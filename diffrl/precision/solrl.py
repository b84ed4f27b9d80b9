"""The Sol-RL two-stage rollout (Sol-RL, "FP4 Explore, BF16 Train", Sec. 3).

1. **Explore.** Each prompt's pool of ``solrl.pool_size`` candidates runs through the
   low-precision exploration copy: independent seeds, the leaves of a BranchGRPO tree,
   or (``explore: ode``) Sol-RL's own recipe, a deterministic ODE with fewer steps.
   The pool is scored with the configured rewards. It keeps only what the next stages
   read: the decoded images until they are scored, the keys, and a tree's layout
   (:class:`~diffrl.sampling.rollout.ExploredPool`, :class:`~diffrl.sampling.tree.TreePool`);
   no per-step latent, mean or log-prob, which nothing reads (at sd35_solrl's size they
   were 8064 MiB in one process).
2. **Select** ``rollout.group_size`` candidates per prompt (:mod:`selection`).
3. **Regenerate** exactly those candidates with the BF16 policy from the same noise:
   independent candidates replay their keys (initial and per-step SDE noise); tree
   candidates regenerate their sub-tree with shared prefixes and the pool's branch
   noise (:mod:`diffrl.sampling.subtree`); an ODE pool replays only the initial noise,
   since the seed fixes the layout. The regenerated samples are re-scored, and only
   they are trained on.

Diagnostics per iteration: Kendall tau and Spearman rho between the selected
candidates' low-precision rewards and their BF16 rewards (Sol-RL reports tau ~ 0.80),
the time of each stage and the NFE of the pool and of the regeneration.

The exploration copy is marked stale after every optimizer step and re-synced (LoRA
merged, weights and scales re-quantized) before it is next used: the copy is read only
when a pool is explored, so this equals syncing after every step without re-quantizing
the whole model once per optimizer step.

Reference: NVlabs/Sana, Sol-RL (``sol_rl``): its pools explore with an NVFP4/FP8 copy
and a deterministic ODE, then regenerate the contrastive subset in BF16 from the same
initial noise, as ``explore: ode`` does here. Deliberate extensions, not in the
reference: tree and SDE-replay pools (``explore: replay``), which regenerate the exact
trajectories rather than only the seeds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from diffrl.precision.selection import rank_agreement, select_subset
from diffrl.runtime.clock import StageClock
from diffrl.sampling import SamplerSettings, get_strategy, rollout_independent
from diffrl.sampling.subtree import regenerate_subtree
from diffrl.sampling.tree import TreeLayout


@dataclass
class SolRLRollout:
    """What stage 2 hands to training: the BF16 samples, their rewards, and logs."""

    traj: object  # Trajectory or (sub-)TreeTrajectory of the regenerated samples
    cond: object  # conditioning indexed by ``traj`` (the pool's for a tree, the selection's otherwise)
    prompts: list[str]  # (k * groups,) prompts of the regenerated samples
    total: torch.Tensor
    components: torch.Tensor
    logs: dict
    selected: torch.Tensor  # (groups, k) pool indices per prompt
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SolRLSettings:
    """What the Sol-RL stage reads from the configuration, and nothing else."""

    solrl: object  # diffrl.config.SolRLConfig: pool size, precision, selection, explore mode
    sampler: SamplerSettings  # handed to the exploring and regenerating samplers
    strategy: str  # rollout.strategy: how a replay pool explores (independent or tree)
    group_size: int  # rollout.group_size: candidates kept per prompt
    family: str  # model.family: which layers the copy keeps in high precision
    perf: object  # diffrl.config.PerfConfig: compiling the copy

    @classmethod
    def of(cls, cfg) -> SolRLSettings:
        if isinstance(cfg, cls):
            return cfg
        return cls(
            cfg.solrl,
            SamplerSettings.of(cfg),
            cfg.rollout.strategy,
            cfg.rollout.group_size,
            cfg.model.family,
            cfg.perf,
        )


class SolRLStage:
    """Owns the exploration copy and runs explore -> select -> regenerate. ``settings``
    is a :class:`SolRLSettings` or a whole config, narrowed to one."""

    def __init__(self, settings, transformer, reward_fn, log=print, align_forwards=None, device=None):
        self.settings, self.reward_fn = SolRLSettings.of(settings), reward_fn
        # FSDP: maps this process's per-level forward counts of a sub-tree regeneration
        # to the counts every process runs (see regenerate_subtree); None runs its own
        self.align_forwards = align_forwards
        s = self.settings
        sol = s.solrl
        self.copy = None
        if sol.precision != "bf16":  # the control explores with the policy itself
            from diffrl.precision.backends import build_exploration_copy

            self.copy = build_exploration_copy(
                transformer,
                s.family,
                sol.precision,
                sol.backend,
                sol.keep_high,
                log=log,
                device=device,
                min_dim=sol.min_quantized_dim,
            )
        else:
            log("solrl: exploring with the policy itself (precision bf16, the control)")
        self.stale = True
        self.syncs = 0
        self._compiled_copy = None
        self._log = log

    def mark_stale(self) -> None:
        """Called after every optimizer step: the policy moved."""
        self.stale = True

    def explorer(self, transformer, rollout_model=None):
        """The model that explores: the synced copy (compiled once under
        ``perf.compile_rollout``; syncs write its weights in place), or for the bf16 control
        ``rollout_model`` (the possibly compiled policy)."""
        if self.copy is None:
            return transformer if rollout_model is None else rollout_model
        if self.stale:
            self.copy.sync(transformer)
            self.stale, self.syncs = False, self.syncs + 1
        if self.copy.backend == "torchao":  # compiled by its backend already
            return self.copy.model
        if self._compiled_copy is None:
            from diffrl.runtime.compile import compiled

            self._compiled_copy = compiled(self.copy.model, self.settings.perf, log=self._log)
        return self._compiled_copy

    # -- stages -----------------------------------------------------------------------
    def explore(self, adapter, model, cond, keys, iteration: int, keep_steps: bool = False):
        """Stage 1 with ``model``, the exploration copy (see :meth:`explorer`): a light pool
        (images, keys, a tree's layout), or with ``keep_steps`` the whole trajectory (what
        tests compare a regeneration with). A strategy that explores takes ``keep_steps``."""
        s, sol = self.settings, self.settings.solrl
        if sol.explore == "ode":
            n = sol.explore_num_steps or s.sampler.sampling.num_steps
            kinds = ["ode"] * n
            return rollout_independent(
                adapter, model, cond, keys, s.sampler, num_steps=n, kinds=kinds, keep_steps=keep_steps
            )
        strategy = get_strategy(s.strategy)
        return strategy(adapter, model, cond, keys, s.sampler, iteration=iteration, keep_steps=keep_steps)

    def regenerate(self, adapter, transformer, cond, pool, flat: torch.Tensor, keys, iteration: int):
        """Stage 3: the candidates ``flat`` regenerated by ``transformer``; a tree pool is
        read for its layout, an independent pool for nothing (``keys`` replay it)."""
        if isinstance(pool, TreeLayout):
            sub = regenerate_subtree(
                adapter, transformer, cond, pool, flat, self.settings.sampler, self.align_forwards
            )
            return sub, cond
        # independent candidates: k per prompt on every process, so the same forwards
        sel = flat.tolist()
        picked = cond.select(sel)
        return rollout_independent(
            adapter, transformer, picked, [keys[i] for i in sel], self.settings.sampler, iteration=iteration
        ), picked

    def run(
        self,
        adapter,
        transformer,
        cond,
        prompts: list[str],
        keys: list[tuple],
        iteration: int,
        autocast=None,
        rollout_model=None,
    ) -> SolRLRollout:
        """One two-stage rollout over this process's whole prompt groups (``keys`` lists
        ``pool_size`` consecutive candidates per prompt). ``transformer`` is the policy the
        copy syncs from; ``rollout_model`` (default: it) runs the regeneration."""
        rollout_model = transformer if rollout_model is None else rollout_model
        sol = self.settings.solrl
        n, k = sol.pool_size, self.settings.group_size
        groups = len(keys) // n
        ctx = autocast or contextlib.nullcontext  # a factory: each stage enters a fresh context
        clock = StageClock(adapter.device)
        with clock.stage("sync"):  # re-quantize if the policy moved since the last pool
            model = self.explorer(transformer, rollout_model)
        with clock.stage("explore"), torch.no_grad(), ctx():
            pool = self.explore(adapter, model, cond, keys, iteration)
        with clock.stage("pool_reward"):
            pool_total, _, _ = self.reward_fn(pool.images, prompts, {"keys": keys})
        pool.images = None  # scored: the regeneration below needs the pool's memory, not its images
        with clock.stage("select"):
            chosen = select_subset(pool_total.reshape(groups, n), k, sol.select, tuple(keys[0][:-1]))
            flat = (chosen + n * torch.arange(groups).unsqueeze(1)).flatten()
        with clock.stage("regenerate"), torch.no_grad(), ctx():
            traj, train_cond = self.regenerate(adapter, rollout_model, cond, pool, flat, keys, iteration)
        sel = flat.tolist()
        sel_prompts = [prompts[i] for i in sel]
        with clock.stage("reward"):
            total, comps, logs = self.reward_fn(traj.images, sel_prompts, {"keys": [keys[i] for i in sel]})
        low = pool_total.reshape(-1)[flat].reshape(groups, k).cpu()
        agree = rank_agreement(low, total.reshape(groups, k).cpu())
        metrics = {
            "solrl/kendall_tau": agree["kendall_tau"],
            "solrl/spearman_rho": agree["spearman_rho"],
            "solrl/pool_reward_mean": float(pool_total.mean()),
            "solrl/selected_pool_reward_mean": float(low.mean()),
            "solrl/explore_nfe": pool.nfe,
            "solrl/regenerate_nfe": traj.nfe,
            "solrl/syncs": self.syncs,
            **clock.metrics,
        }
        return SolRLRollout(traj, train_cond, sel_prompts, total, comps, logs, chosen, metrics)
