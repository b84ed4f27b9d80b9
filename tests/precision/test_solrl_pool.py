"""A Sol-RL exploration pool keeps only what selection and regeneration read (issue 37,
defect 6; Sol-RL, "FP4 Explore, BF16 Train", Sec. 3): its decoded images until they are
scored, its keys, and a tree pool's layout. No per-step latent, mean or log-prob (nothing
reads them; at sd35_solrl's size they were 8064 MiB in one process), and the BF16
regeneration is bit for bit what it was when the pool kept everything.

The toy family is pixel space, so a latent is as large as an image: a pool that still kept
its (T + 1) latents and T means per candidate would hold 2T + 2 times the images measured
here."""

import dataclasses

import pytest
import torch

from diffrl.perf.estimate import POOL, estimate_built
from diffrl.perf.holdings import live_tensor_bytes
from diffrl.sampling.subtree import subtree_nodes
from diffrl.sampling.tree import TreeLayout
from diffrl.training.data import plan_step
from diffrl.training.trainer import Trainer
from tests.helpers import quick_config

KIB = 2**10
# the bf16 control explores with the policy itself, so the regeneration must reproduce
# the pool exactly; one row per forward keeps the two stages' batches identical
BASE = ["solrl.enabled=true", "solrl.precision=bf16", "rollout.batch_size=1"]
CASES = {
    "independent": [],
    "ode": ["solrl.explore=ode", "solrl.explore_num_steps=3"],
    "tree": [
        "rollout.strategy=tree",
        "tree.split_steps=[0,1,2]",
        "tree.branch_factors=[2]",
        "solrl.pool_size=8",
    ],
}


def _trainer(tmp_path, case):
    return Trainer(quick_config("tiny_toy_flowgrpo", tmp_path, *BASE, *CASES[case]))


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors an object's fields hold (what it keeps alive)."""
    values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _spied_run(trainer):
    """One Sol-RL rollout, recording the pool the regeneration receives, the live tensor
    bytes when exploring starts and when the pool is scored, and the pool's images."""
    stage, seen = trainer.precision.solrl, {}
    explorer, regenerate, reward_fn = stage.explorer, stage.regenerate, stage.reward_fn

    def spy_explorer(*args, **kwargs):
        model = explorer(*args, **kwargs)
        seen["before"] = live_tensor_bytes()
        return model

    def spy_reward(images, *args, **kwargs):
        if "scoring" not in seen:  # the first call scores the pool
            seen["scoring"], seen["images"] = live_tensor_bytes(), images
        return reward_fn(images, *args, **kwargs)

    def spy_regenerate(adapter, transformer, cond, pool, *args, **kwargs):
        seen["pool"] = pool
        return regenerate(adapter, transformer, cond, pool, *args, **kwargs)

    stage.explorer, stage.regenerate, stage.reward_fn = spy_explorer, spy_regenerate, spy_reward
    cfg = trainer.cfg
    plan = plan_step(
        trainer.session.train_prompts, cfg.seed, 0, cfg.rollout.prompts_per_step, cfg.solrl.pool_size
    )
    cond = trainer.adapter.encode_prompts(plan.prompts)
    out = stage.run(trainer.adapter, trainer.adapter.transformer, cond, plan.prompts, plan.keys, 0)
    return out, seen, plan, cond


@pytest.mark.parametrize("case", list(CASES))
def test_the_pool_keeps_no_steps_and_the_regeneration_is_unchanged(case, tmp_path):
    trainer = _trainer(tmp_path, case)
    out, seen, plan, cond = _spied_run(trainer)
    pool = seen["pool"]
    assert not any(hasattr(pool, name) for name in ("latents", "means", "log_probs", "noise"))
    assert pool.images is None  # scored, then dropped before the regeneration
    assert pool.keys == plan.keys and pool.nfe == out.metrics["solrl/explore_nfe"]
    # what remains is a tree's layout (four int64 per node, and the sigmas) or nothing
    layout = 4 * 8 * pool.depth.numel() + pool.sigmas.numel() * 4 if case == "tree" else 0
    assert _tensor_bytes(pool) == layout
    # the old path: a pool that kept every step, which the regeneration reproduces exactly
    stage = trainer.precision.solrl
    full = stage.explore(trainer.adapter, trainer.adapter.transformer, cond, plan.keys, 0, keep_steps=True)
    n, traj = stage.settings.solrl.pool_size, out.traj
    flat = (out.selected + n * torch.arange(out.selected.shape[0]).unsqueeze(1)).flatten()
    assert torch.equal(seen["images"], full.images)  # selection scored the same images
    if isinstance(pool, TreeLayout):  # its edge noise is redrawn from the keys: the pool's own draws
        nodes = subtree_nodes(full, flat)
        for name in ("noise", "latents", "means", "log_probs"):
            assert torch.equal(getattr(traj, name), getattr(full, name)[nodes]), name
        assert torch.equal(traj.images, full.images[flat])
    elif case == "ode":  # Sol-RL's ODE pool fixes only the initial noise
        assert torch.equal(traj.latents[:, 0], full.latents[flat, 0])
    else:
        for name in ("latents", "means", "log_probs", "images"):
            assert torch.equal(getattr(traj, name), getattr(full, name)[flat]), name


@pytest.mark.parametrize("case", ["independent", "tree"])
def test_the_estimate_counts_what_the_pool_holds_when_it_is_scored(case, tmp_path):
    """Exploring allocates the pool's images (and a tree's layout), which the estimate's
    pool part counts; a pool that kept its steps would measure 2T + 2 times the images.
    The regenerated samples fit the trajectory buffer (for a tree: the sub-tree's bound)."""
    trainer = _trainer(tmp_path, case)
    out, seen, _, _ = _spied_run(trainer)
    grown = seen["scoring"] - seen["before"]
    parts = estimate_built(trainer.cfg, trainer.adapter, trainer.policy, trainer.reward_fn)
    estimated = parts[POOL]
    # the regenerated samples: a sub-tree's latents, means and noise stay within the plan's bound
    assert _tensor_bytes(out.traj) - out.traj.images.numel() * 4 <= parts["trajectory buffer"] + 4 * KIB
    images = seen["images"].numel() * seen["images"].element_size()
    assert images > 50 * KIB  # the images are most of what the estimate counts
    assert abs(grown - estimated) <= 4 * KIB, (grown / KIB, estimated / KIB, images / KIB)
