"""BranchGRPO in the training loop: two steps on the tiny FLUX and Wan twins, pruning
that leaves the rollout alone and removes exactly the intended edges from the gradient,
edges that train with their child's advantage, and the run plan's NFE numbers."""

import pytest
import torch

from diffrl.algorithms.tree_credit import tree_credit
from diffrl.config import ConfigError, load_config
from diffrl.sampling import TreeSpec
from diffrl.training.plan import derive
from diffrl.training.trainer import Trainer
from tests.helpers import fit_until_killed, quick_config


def _cfg(name, tmp_path, *overrides):
    return quick_config(name, tmp_path / name, *overrides)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.trainable_named_parameters()}


@pytest.mark.parametrize("name", ["tiny_flux_branchgrpo", "tiny_wan_branchgrpo"])
def test_two_tree_steps_change_parameters_with_finite_loss(name, tmp_path):
    trainer = Trainer(_cfg(name, tmp_path))
    before = _params(trainer)
    history = trainer.fit()
    after = _params(trainer)
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert sum(not torch.equal(before[n], after[n]) for n in before) > 0
    spec = TreeSpec.from_config(trainer.cfg)
    prompts = trainer.cfg.rollout.prompts_per_step
    assert history[-1]["rollout/nfe"] == prompts * spec.nfe_per_tree()
    assert history[-1]["rollout/nfe_per_leaf"] == spec.nfe_per_tree() / spec.leaves
    assert 0 < history[-1]["tree/edges_after_pruning"] <= history[-1]["tree/edges"]
    # equal to the plan's trained transitions because timestep_fraction is 1 here
    assert history[-1]["tree/edges_after_pruning"] == trainer.numbers["trained_transitions_per_iteration"]


def _rollout(trainer, step=0):
    r = trainer.rollout_and_score(step)
    return r.cond, r.traj, r.total, r.components


def test_pruning_leaves_the_rollout_and_the_advantages_unchanged(tmp_path):
    pruned = Trainer(_cfg("tiny_flux_branchgrpo", tmp_path))
    full = Trainer(_cfg("tiny_flux_branchgrpo", tmp_path, "tree.width_pruning=none", "tree.depth_pruning=[]"))
    _, a, ra, ca = _rollout(pruned)
    _, b, rb, cb = _rollout(full)
    for name in ("latents", "log_probs", "noise", "parent", "images"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(ra, rb)
    credit_a = tree_credit(a, ra, ca, pruned.cfg, 0)
    credit_b = tree_credit(b, rb, cb, full.cfg, 0)
    assert torch.equal(credit_a.advantages, credit_b.advantages)
    assert credit_a.train.sum() < credit_b.train.sum() and not (credit_a.train & ~credit_b.train).any()


class _Spy:
    """Wraps the Updater's batch builder to record the rows and the batch of every pass."""

    def __init__(self, build):
        self.build, self.calls = build, []

    def __call__(self, traj, cond, advantages, p):
        batch = self.build(traj, cond, advantages, p)
        self.calls.append((p.rows, batch))
        return batch


def _grads_of_one_update(trainer, cond, traj, credit):
    """Gradients accumulated by one optimizer step of the Updater (the step itself is
    intercepted, so parameters do not move)."""
    grads = []
    params = list(trainer.policy.trainable_parameters())
    trainer.optimizer.step = lambda *a, **k: grads.append([p.grad.clone() for p in params])
    trainer.scheduler.step = lambda *a, **k: None
    from diffrl.training.stages import Credit

    typed = Credit(
        credit.node_rewards, credit.advantages, credit.keep, credit.filtered_fraction, 0, credit.train
    )
    trainer.updater.run(traj, cond, typed, 0)
    assert len(grads) == 1
    return torch.cat([g.flatten() for g in grads[0]])


def test_pruned_edges_are_exactly_the_ones_missing_from_the_gradient(tmp_path):
    # one optimizer step over every trained edge, no clipping, no KL; SDE on every step so
    # that the leaf edges (after the last split) are trained unless width-pruned
    trainer = Trainer(
        _cfg(
            "tiny_flux_branchgrpo",
            tmp_path,
            "sampling.sde_window=null",
            "train.micro_batch_size=64",
            "train.num_inner_epochs=1",
            "optim.max_grad_norm=0",
            "objective.kl_coef=0",
            "objective.clip_range=1e3",
        )
    )
    spy = _Spy(trainer.updater._step_batch)
    trainer.updater._step_batch = spy
    cond, traj, total, comps = _rollout(trainer)
    credit = tree_credit(traj, total, comps, trainer.cfg, 0)
    base = _grads_of_one_update(trainer, cond, traj, credit)
    seen = sorted(r for rows, _ in spy.calls for r in rows)
    assert seen == torch.nonzero(credit.train).flatten().tolist()
    for rows, batch in spy.calls:
        assert torch.equal(batch.advantages, credit.advantages[torch.tensor(rows)])  # the child's advantage
        assert torch.equal(batch.x_t, traj.latents[traj.parent[torch.tensor(rows)]])
        assert torch.equal(batch.weights, credit.keep[torch.tensor(rows)].float())  # masked edges weigh 0

    leaves = traj.leaf_nodes()
    pruned_leaf = int(leaves[~credit.train[leaves]][0])
    kept_leaf = int(leaves[credit.train[leaves] & (credit.advantages[leaves] != 0)][0])
    for leaf, should_change in ((pruned_leaf, False), (kept_leaf, True)):
        saved = traj.latents[leaf].clone()
        traj.latents[leaf] += 0.5  # moves only the edge into this leaf
        moved = _grads_of_one_update(trainer, cond, traj, credit)
        traj.latents[leaf] = saved
        assert torch.equal(moved, base) != should_change, leaf
    assert base.abs().sum() > 0


def test_run_plan_reports_tree_nfe():
    cfg = load_config("toy_branchgrpo")
    numbers = derive(cfg)
    assert numbers["rollout_nfe_per_iteration"] == 16 * (1 + 2 + 4 + 8 + 6 * 16)
    assert numbers["rollout_nfe_per_leaf"] == (1 + 2 + 4 + 8 + 6 * 16) / 16
    assert numbers["rollout_nfe_vs_independent"] == (1 + 2 + 4 + 8 + 6 * 16) / 160
    assert numbers["trained_transitions_per_iteration"] == 16 * (2 + 4 + 8 + 16)
    with pytest.raises(ConfigError, match="divisible by the 3 processes"):
        derive(cfg, num_processes=3)
    everything_pruned = load_config("toy_branchgrpo", ["tree.depth_pruning=[0,1,2,3]"])
    with pytest.raises(ConfigError, match="trains no edge"):
        derive(everything_pruned)


def test_tree_run_resumes_to_the_same_weights(tmp_path):
    """4 steps == 2 steps + kill + resume, with iteration-dependent sliding windows."""
    overrides = (
        "train.max_steps=4",
        "checkpoint.every=2",
        "sampling.sde_window=[0,2]",
        "sampling.sde_window_slide_every=1",
        "tree.depth_pruning=[3]",
        "tree.depth_pruning_slide_every=2",
    )
    full = Trainer(_cfg("tiny_flux_branchgrpo", tmp_path / "full", *overrides))
    full.fit()
    fit_until_killed(Trainer(_cfg("tiny_flux_branchgrpo", tmp_path / "killed", *overrides)), 2)
    resumed = Trainer(_cfg("tiny_flux_branchgrpo", tmp_path / "killed", *overrides))
    resumed.resume("latest")
    resumed.fit()
    a, b = _params(full), _params(resumed)
    fresh = _params(Trainer(_cfg("tiny_flux_branchgrpo", tmp_path / "fresh")))
    assert any(not torch.equal(a[n], fresh[n]) for n in a)  # the runs did train
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


def test_a_nan_leaf_reward_drops_its_whole_tree_and_leaves_the_others_as_they_were(tmp_path):
    trainer = Trainer(_cfg("tiny_flux_branchgrpo", tmp_path))
    _, traj, total, comps = _rollout(trainer)
    clean = tree_credit(traj, total, comps, trainer.cfg, 0)
    poisoned_total = total.clone()
    leaves = traj.leaf_nodes()
    poisoned_total[0] = float("nan")  # the first leaf, in tree 0
    credit = tree_credit(traj, poisoned_total, comps, trainer.cfg, 0)
    bad_tree = traj.tree == traj.tree[leaves[0]]
    assert traj.num_trees > 1 and credit.dropped_groups > 0
    assert not bool(credit.keep[bad_tree].any()) and torch.equal(
        credit.advantages[bad_tree], torch.zeros(int(bad_tree.sum()))
    )
    # the group estimator normalises per (tree, depth): the other trees are untouched
    assert trainer.cfg.advantage.estimator == "group"
    assert torch.equal(credit.advantages[~bad_tree], clean.advantages[~bad_tree])
    assert torch.equal(credit.keep[~bad_tree], clean.keep[~bad_tree])
