"""The objectives added after flow-GRPO and DiffusionNFT (GRPO-Guard, Flow-DPPO, AWM,
DGPO) in the loop: two iterations on a tiny twin with independent rollouts, trees and
Sol-RL's regenerated subsets; AWM's EMA anchor resumed exactly; DGPO's passes of whole
groups; and one clear start-up error for each unsupported combination."""

import pytest
import torch

from diffrl.config import ConfigError, load_config
from diffrl.training.passes import sample_major
from diffrl.training.plan import derive
from diffrl.training.trainer import Trainer
from tests.helpers import fit_until_killed, quick_config

STRATEGIES = {
    "independent": ("tiny_flux_flowgrpo", ()),
    "tree": ("tiny_flux_branchgrpo", ("tree.width_pruning=none",)),
    "solrl": ("tiny_flux_solrl", ()),
}
OWN_STATS = {
    "grpo_guard": "clipfrac",
    "flow_dppo": "dppo/masked",
    "awm": "awm/fm_error",
    "dgpo": "dgpo/group_weight",
}
# DGPO's micro-batches hold whole groups (tiny configs: groups of 4, trees of 8 leaves)
EXTRA = {"dgpo": ("train.micro_batch_size=8",), "grpo_guard": ("objective.clip_range=1e-3",)}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("objective", list(OWN_STATS))
def test_two_iterations_train_and_log_the_objectives_statistics(objective, strategy, tmp_path):
    name, overrides = STRATEGIES[strategy]
    cfg = quick_config(name, tmp_path, f"objective.name={objective}", *overrides, *EXTRA.get(objective, ()))
    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    history = trainer.fit()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert trainer.counters.optimizer_steps >= 2 and trainer.counters.skipped_nonfinite_loss == 0
    moved = [not torch.equal(a, b) for a, b in zip(start, trainer.policy.trainable_parameters())]
    assert any(moved)
    assert OWN_STATS[objective] in history[-1]


def test_awm_resumes_with_the_same_policy_and_ema_anchor(tmp_path):
    overrides = ("train.max_steps=4", "checkpoint.every=2", "objective.name=awm")
    overrides += ("objective.args.old_decay_rate=0.1",)  # a decay that moves within 4 iterations
    full = Trainer(quick_config("tiny_flux_flowgrpo", tmp_path / "full", *overrides))
    full.fit()
    killed = Trainer(quick_config("tiny_flux_flowgrpo", tmp_path / "killed", *overrides))
    fit_until_killed(killed, 2)
    resumed = Trainer(quick_config("tiny_flux_flowgrpo", tmp_path / "killed", *overrides))
    resumed.resume("latest")
    resumed.fit()
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters()):
        assert torch.equal(a, b)
    for a, b in zip(full.old_policy.shadow, resumed.old_policy.shadow):
        assert torch.equal(a, b)
    assert any(
        not torch.equal(s, p.float())
        for s, p in zip(full.old_policy.shadow, full.policy.trainable_parameters())
    )


def test_whole_group_plan_keeps_each_group_in_one_micro_batch():
    cfg = load_config("toy_dgpo")  # micro-batches of 64 = 4 groups of 16
    groups = torch.arange(256) // 16
    plan = sample_major(256, [0, 1, 2, 3], cfg, step=3, epoch=1, groups=groups)
    seen = set()
    for passes in plan:
        for p in passes:
            members = groups[torch.as_tensor(p.rows)]
            assert all(int((members == g).sum()) == 16 for g in members.unique())
            seen |= set(p.rows)
    assert seen == set(range(256))
    again = sample_major(256, [0, 1, 2, 3], cfg, step=4, epoch=1, groups=groups)
    assert [p.rows for p in plan[0]] != [p.rows for p in again[0]]  # groups are reshuffled


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["objective.name=awn"], "objective.name=awn: unknown objective 'awn'. Did you mean 'awm'"),
        (["objective.name=dgpo", "train.micro_batch_size=6"], "a multiple of rollout.group_size"),
        (["objective.name=grpo_guard", "objective.logprob_reduction=sum"], "logprob_reduction mean"),
        (["objective.forward_window=[0, 4]"], "applies to clean-sample objectives"),
        (["objective.name=awm", "objective.forward_window=[3, 99]"], "forward_window must be"),
        (["objective.name=dgpo", "objective.args.beta=0"], "objective.args.beta must be > 0"),
        (["objective.name=flow_dppo", "objective.args.kl_threshold=-1"], "args.kl_threshold must be > 0"),
        (["objective.name=nft", "objective.args.old_decay_max=1"], "old_decay_max in \\[0, 1\\)"),
        (["objective.name=awm", "objective.args.betta=1"], "unknown key 'objective.args.betta'"),
    ],
)
def test_unsupported_combinations_fail_at_start_with_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_flux_flowgrpo", overrides)


def test_dgpo_needs_whole_groups_on_every_process():
    cfg = load_config("tiny_flux_flowgrpo", ["objective.name=dgpo", "rollout.prompts_per_step=3"])
    with pytest.raises(ConfigError, match="compares each prompt's whole group"):
        derive(cfg, num_processes=2)
    derive(load_config("tiny_flux_flowgrpo", ["rollout.prompts_per_step=3"]), num_processes=2)


def test_prompt_groups_follow_the_keys_and_the_trees():
    from types import SimpleNamespace

    from diffrl.training.update import _prompt_groups

    keys = [(0, 5, 2, 0), (0, 5, 7, 0), (0, 5, 2, 1), (0, 5, 7, 1), (0, 5, 9, 0)]
    groups = _prompt_groups(SimpleNamespace(keys=keys), [0, 1, 2, 3, 4])
    assert groups.tolist() == [0, 1, 0, 1, 2]  # prompt 2, prompt 7, prompt 9
    tree = SimpleNamespace(keys=keys, tree=torch.tensor([0, 0, 1, 1, 1, 2]))
    assert _prompt_groups(tree, [5, 2, 0]).tolist() == [2, 1, 0]


def test_an_objective_refuses_the_strategies_it_does_not_declare():
    from diffrl.algorithms.flow_grpo import flow_grpo_loss
    from diffrl.algorithms.objective import OBJECTIVES, Objective, register_objective

    register_objective(Objective("independent_only", flow_grpo_loss, strategies=("independent",)))
    try:
        load_config("tiny_flux_flowgrpo", ["objective.name=independent_only"])  # supported
        with pytest.raises(ConfigError, match="does not support tree rollouts; it supports independent"):
            load_config("tiny_flux_branchgrpo", ["objective.name=independent_only"])
        with pytest.raises(ConfigError, match="does not support solrl rollouts"):
            independent_pool = ["objective.name=independent_only", "rollout.strategy=independent"]
            load_config("tiny_flux_solrl", independent_pool)
    finally:
        OBJECTIVES.unregister("independent_only")


RLCM = (
    "objective.name=rlcm",
    "sampling.sde_type=consistency",
    "sampling.sigma_shift=1.0",
    "objective.kl_coef=0",
    "advantage.estimator=prompt_history",
    "advantage.history_size=8",
    "advantage.history_min_count=3",
    "rollout.prompts_per_step=2",
)


def test_rlcm_trains_the_consistency_transitions_and_resumes_with_the_same_prompt_history(tmp_path):
    """Issue 63: RLCM end to end on the toy twin. Killed after 2 of 4 iterations and
    resumed, the run ends with the same weights and the same per-prompt reward history as
    the uninterrupted one (the history is part of the checkpoint)."""
    overrides = ("train.max_steps=4", "checkpoint.every=2", *RLCM)
    full = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path / "full", *overrides))
    full.fit()
    assert full.prompt_history.rewards and all(len(v) <= 8 for v in full.prompt_history.rewards.values())
    killed = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path / "killed", *overrides))
    fit_until_killed(killed, 2)
    resumed = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path / "killed", *overrides))
    resumed.resume("latest")
    assert resumed.prompt_history.rewards == killed.prompt_history.rewards
    resumed.fit()
    assert resumed.prompt_history.rewards == full.prompt_history.rewards
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters()):
        assert torch.equal(a, b)


def test_a_consistency_rollout_replays_exactly_and_leaves_its_last_step_untrained(tmp_path):
    """The stored transitions rescored by the same policy give ratio 1 exactly, the three
    re-noising steps are trainable, the last (the clean prediction) is not."""
    from diffrl.sampling import SamplerSettings
    from diffrl.sampling.rollout import rollout_independent

    trainer = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path, *RLCM))
    cond = trainer.adapter.encode_prompts(["a red circle", "a red circle"])
    settings = SamplerSettings.of(trainer.cfg)
    with torch.no_grad():
        traj = rollout_independent(
            trainer.adapter, trainer.model, cond, [(0, 0, 0, 0), (0, 0, 0, 1)], settings
        )
    assert traj.step_kinds == ["consistency"] * 3 + ["ode"] and traj.trainable_steps() == [0, 1, 2]
    from diffrl.sampling.sde import step

    for t in traj.trainable_steps():
        with torch.no_grad():
            v = trainer.adapter.velocity(trainer.model, traj.latents[:, t], traj.sigmas[t].expand(2), cond)
        again = step(
            "consistency",
            traj.latents[:, t],
            v,
            traj.sigmas[t],
            traj.sigmas[t + 1],
            0.7,
            next_latents=traj.latents[:, t + 1],
        )
        assert torch.equal(again.log_prob, traj.log_probs[:, t])


def test_a_consistency_step_to_a_level_just_above_zero_is_refused(tmp_path):
    """The toy scheduler's own 4-step grid ends at sigma 1/1000: a re-noising step there
    has std 0.001 and an exploding ratio, so the rollout refuses it and names the fix."""
    from diffrl.sampling import SamplerSettings
    from diffrl.sampling.rollout import rollout_independent

    sets = [x for x in RLCM if not x.startswith("sampling.sigma_shift")]
    trainer = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path, *sets))
    cond = trainer.adapter.encode_prompts(["a red circle"])
    with pytest.raises(ValueError, match=r"re-noises step 2 to sigma 0\.0010.*set sampling\.sigma_shift"):
        rollout_independent(
            trainer.adapter, trainer.model, cond, [(0, 0, 0, 0)], SamplerSettings.of(trainer.cfg)
        )


@pytest.mark.parametrize("objective", ["flow_grpo", "nft"])
def test_flow_grpo_and_diffusionnft_train_on_the_consistency_sampler_too(tmp_path, objective):
    """Issue 63: the comparison objectives run through the same few-step sampler (flow-GRPO
    on its stored transitions, DiffusionNFT on the clean samples) and change the policy."""
    sets = ["sampling.sde_type=consistency", "sampling.sigma_shift=1.0", f"objective.name={objective}"]
    sets += ["train.max_steps=1", "eval.every=0"]
    trainer = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path, *sets))
    before = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    trainer.fit()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.trainable_parameters()))
