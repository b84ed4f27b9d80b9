"""Sol-RL two-stage rollouts: with precision bf16 stage 2 reproduces stage 1's selected
samples (independent and tree pools), sub-trees share prefixes, the pool's noise is
replayed, the exploration copy is re-synced after optimizer steps, and short training
runs (toy_solrl, tiny_flux_solrl with a reference NVFP4 pool, NFT) work and resume."""

import pytest
import torch

from diffrl.config import ConfigError, load_config
from diffrl.precision.exploration import ExplorationCopy
from diffrl.precision.solrl import SolRLStage
from diffrl.sampling.subtree import subtree_nodes
from diffrl.training.data import plan_step
from diffrl.training.trainer import Trainer
from tests.helpers import fit_until_killed, quick_config


def _cfg(name, tmp_path, *overrides):
    return quick_config(name, tmp_path / name, *overrides)


def _stage_run(trainer, step=0):
    cfg = trainer.cfg
    plan = plan_step(
        trainer.session.train_prompts, cfg.seed, step, cfg.rollout.prompts_per_step, cfg.solrl.pool_size
    )
    cond = trainer.adapter.encode_prompts(plan.prompts)
    stage = trainer.precision.solrl
    with torch.no_grad():
        model = stage.explorer(trainer.adapter.transformer)
        pool = stage.explore(trainer.adapter, model, cond, plan.keys, step, keep_steps=True)
    out = stage.run(trainer.adapter, trainer.adapter.transformer, cond, plan.prompts, plan.keys, step)
    return pool, out, plan


def _perturb(trainer, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("batch_size", [1, 8])
def test_bf16_independent_pool_is_reproduced_exactly(tmp_path, batch_size):
    trainer = Trainer(
        _cfg(
            "tiny_flux_solrl",
            tmp_path,
            "rollout.strategy=independent",
            "solrl.precision=bf16",
            f"rollout.batch_size={batch_size}",
        )
    )
    _perturb(trainer)
    pool, out, plan = _stage_run(trainer)
    n, k = trainer.cfg.solrl.pool_size, trainer.cfg.rollout.group_size
    flat = (out.selected + n * torch.arange(out.selected.shape[0]).unsqueeze(1)).flatten()
    assert out.traj.keys == [plan.keys[i] for i in flat.tolist()]
    assert out.traj.step_noise is None and pool.step_noise is None  # training keeps no noise
    if batch_size == 1:  # every forward is one row in both stages: bit for bit
        assert torch.equal(out.traj.latents, pool.latents[flat])
        assert torch.equal(out.traj.log_probs, pool.log_probs[flat])
    else:
        torch.testing.assert_close(out.traj.latents, pool.latents[flat], rtol=1e-5, atol=1e-5)
    assert out.selected.shape == (trainer.cfg.rollout.prompts_per_step, k)
    assert out.metrics["solrl/explore_nfe"] == len(plan.keys) * trainer.cfg.sampling.num_steps


@pytest.mark.parametrize("batch_size,shared", [(1, 1), (8, 1), (8, 2)])
def test_bf16_tree_pool_sub_tree_is_reproduced_exactly(tmp_path, batch_size, shared):
    """shared 2: the two trees share their root noise (tree.shared_root_noise), and the
    sub-tree regeneration replays that shared root."""
    sets = ["solrl.precision=bf16", f"rollout.batch_size={batch_size}", f"tree.shared_root_noise={shared}"]
    trainer = Trainer(_cfg("tiny_flux_solrl", tmp_path, *sets))
    _perturb(trainer)
    pool, out, _ = _stage_run(trainer)
    n = trainer.cfg.solrl.pool_size
    leaves = (out.selected + n * torch.arange(out.selected.shape[0]).unsqueeze(1)).flatten()
    nodes = subtree_nodes(pool, leaves)
    sub = out.traj
    for name in ("depth", "tree", "ordinal", "noise"):
        assert torch.equal(getattr(sub, name), getattr(pool, name)[nodes]), name
    assert torch.equal(nodes[sub.parent[sub.depth > 0]], pool.parent[nodes[sub.depth > 0]])
    close = torch.equal if batch_size == 1 else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    for name in ("latents", "log_probs", "means"):
        assert close(getattr(sub, name), getattr(pool, name)[nodes]), name
    assert sub.keys == [pool.keys[i] for i in leaves.tolist()]
    # shared prefixes: one evaluation per kept non-leaf node, fewer than leaf by leaf
    assert sub.nfe == int((sub.depth < sub.num_steps).sum())
    assert sub.nfe < len(leaves) * sub.num_steps


def test_aligned_sub_tree_runs_the_common_forward_counts_and_the_same_numbers(tmp_path):
    """FSDP alignment (idle forwards): told that another process runs two more forwards
    per level, the regeneration runs exactly those extra forwards, and its sub-tree, NFE
    and rewards do not change (the idle rows are dropped)."""
    trainer = Trainer(_cfg("tiny_flux_solrl", tmp_path, "solrl.precision=bf16", "rollout.batch_size=2"))
    _perturb(trainer)
    _, plain, _ = _stage_run(trainer)
    calls, asked = [], []
    regenerate = trainer.precision.solrl.regenerate

    def counted_regenerate(*args, **kwargs):  # count the transformer's forwards in stage 2 only
        hook = trainer.adapter.transformer.register_forward_hook(lambda *_: calls.append(1))
        try:
            return regenerate(*args, **kwargs)
        finally:
            hook.remove()

    trainer.precision.solrl.regenerate = counted_regenerate
    trainer.precision.solrl.align_forwards = lambda counts: (
        asked.append(list(counts)) or [c + 2 for c in counts]
    )
    _, aligned, _ = _stage_run(trainer)
    sub = aligned.traj
    steps = sub.num_steps
    assert asked == [[-(-int((sub.depth == t).sum()) // 2) for t in range(steps)]]  # chunks of 2
    assert len(calls) == sum(asked[0]) + 2 * steps
    assert sub.nfe == plain.traj.nfe
    assert torch.equal(sub.latents, plain.traj.latents) and torch.equal(aligned.total, plain.total)


def test_low_precision_pool_replays_noise_but_differs(tmp_path):
    trainer = Trainer(_cfg("tiny_flux_solrl", tmp_path))
    _perturb(trainer)
    pool, out, _ = _stage_run(trainer)
    nodes = subtree_nodes(pool, (out.selected + 8 * torch.arange(2).unsqueeze(1)).flatten())
    assert torch.equal(out.traj.noise, pool.noise[nodes])
    assert not torch.allclose(out.traj.latents, pool.latents[nodes], atol=1e-4)
    assert (
        -1 <= out.metrics["solrl/kendall_tau"] <= 1
        or out.metrics["solrl/kendall_tau"] != out.metrics["solrl/kendall_tau"]
    )


def test_ode_pool_replays_only_the_initial_noise(tmp_path):
    trainer = Trainer(
        _cfg(
            "tiny_flux_solrl",
            tmp_path,
            "rollout.strategy=independent",
            "solrl.explore=ode",
            "solrl.explore_num_steps=3",
            "solrl.precision=bf16",
        )
    )
    pool, out, plan = _stage_run(trainer)
    flat = (out.selected + 8 * torch.arange(2).unsqueeze(1)).flatten()
    assert pool.num_steps == 3 and set(pool.step_kinds) == {"ode"}
    assert torch.equal(out.traj.latents[:, 0], pool.latents[flat, 0])
    assert out.traj.num_steps == trainer.cfg.sampling.num_steps
    assert out.metrics["solrl/explore_nfe"] == len(plan.keys) * 3


def test_exploration_copy_is_resynced_after_optimizer_steps(tmp_path):
    trainer = Trainer(_cfg("tiny_flux_solrl", tmp_path))
    stage: SolRLStage = trainer.precision.solrl
    model = stage.explorer(trainer.adapter.transformer)
    assert stage.syncs == 1 and stage.explorer(trainer.adapter.transformer) is model and stage.syncs == 1
    trainer.fit()  # optimizer steps mark the copy stale
    assert trainer.counters.optimizer_steps > 0 and stage.stale
    fresh = ExplorationCopy(trainer.adapter.transformer, "nvfp4", stage.copy.keep_high)
    stage.explorer(trainer.adapter.transformer)
    # one sync before each later iteration (the copy moved) and this one
    assert not stage.stale and stage.syncs == 1 + trainer.cfg.train.max_steps
    for (name, a), b in zip(stage.copy.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("tiny_flux_solrl", ()),
        ("tiny_flux_solrl", ("rollout.strategy=independent", "solrl.select=random", "solrl.precision=fp8")),
        ("tiny_flux_solrl", ("objective.name=nft", "objective.kl_coef=0.01")),
        # compiled rollouts are covered by tests/perf/test_runtime.py; eager here keeps CI fast
        (
            "toy_solrl",
            (
                "rollout.prompts_per_step=2",
                "rollout.batch_size=32",
                "train.micro_batch_size=8",
                "eval.at_start=false",
                "perf.compile_rollout=false",
            ),
        ),
    ],
)
def test_two_solrl_steps_train_with_finite_loss(name, overrides, tmp_path):
    trainer = Trainer(_cfg(name, tmp_path, *overrides))
    before = {n: p.detach().clone() for n, p in trainer.policy.trainable_named_parameters()}
    history = trainer.fit()
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert any(not torch.equal(before[n], p) for n, p in trainer.policy.trainable_named_parameters())
    row = history[-1]
    assert row["rollout/nfe"] == row["solrl/explore_nfe"] + row["solrl/regenerate_nfe"]
    for key in (
        "time/sync",
        "time/explore",
        "time/regenerate",
        "time/update",
        "solrl/kendall_tau",
        "solrl/spearman_rho",
    ):
        assert key in row
    assert row["solrl/explore_nfe"] == trainer.numbers["solrl_explore_nfe_per_iteration"]
    assert row["solrl/regenerate_nfe"] <= trainer.numbers["solrl_regenerate_nfe_per_iteration"]
    if "tree/edges_after_pruning" in row:  # a sub-tree: the plan gives the bound
        assert 0 < row["tree/edges_after_pruning"] <= trainer.numbers["trained_transitions_per_iteration_max"]


@pytest.mark.parametrize("objective", ["flow_grpo", "nft"])
def test_solrl_resume_equivalence(objective, tmp_path):
    overrides = (
        "train.max_steps=4",
        "checkpoint.every=2",
        f"objective.name={objective}",
        *(["objective.args.old_decay_rate=0.3"] if objective == "nft" else []),
    )
    full = Trainer(_cfg("tiny_flux_solrl", tmp_path / "full", *overrides))
    full.fit()
    killed = Trainer(_cfg("tiny_flux_solrl", tmp_path / "killed", *overrides))
    fit_until_killed(killed, 2)
    resumed = Trainer(_cfg("tiny_flux_solrl", tmp_path / "killed", *overrides))
    resumed.resume("latest")
    resumed.fit()
    for (name, a), b in zip(full.policy.trainable_named_parameters(), resumed.policy.trainable_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    if objective == "nft":
        for a, b in zip(full.old_policy.shadow, resumed.old_policy.shadow):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.group_size=9", "need 2 <= group_size <= pool_size"),
        ("solrl.explore=ode", "replays only the initial noise"),
        ("tree.width_pruning=best_worst", "set tree.width_pruning none"),
        ("solrl.pool_size=16", "the tree has 8 leaves per prompt but solrl.pool_size is 16"),
        ("solrl.select=top", "solrl.select"),
    ],
)
def test_solrl_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_flux_solrl", [override])


def test_rollouts_compiled_by_block_give_the_eager_run(tmp_path, monkeypatch):
    """perf.compile_rollout with the default scope (by block) in a real Sol-RL run: the
    policy's blocks compile in place before the exploration copy is made, the copy
    compiles its own, and the run is the eager run (dynamo traces every block with
    fullgraph; its 'eager' backend runs the traced graphs, so the numbers are eager's
    and no C++ compile is paid here)."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    runs, lines = {}, []
    for compiled in ("false", "true"):
        trainer = Trainer(_cfg("tiny_flux_solrl", tmp_path / compiled, f"perf.compile_rollout={compiled}"))
        if compiled == "true":
            trainer.acc.print = lines.append  # what the rollout model's first call logs
            trainer.rollout_model._log = lines.append
            trainer.precision.solrl._log = lines.append
        runs[compiled] = trainer.fit()
    by_block = [line for line in lines if "compiled by block; first calls" in line]
    assert len(by_block) == 2  # the policy's rollouts and the exploration copy
    assert not any("failed" in line for line in lines)
    for eager, fast in zip(runs["false"], runs["true"]):
        assert fast["loss"] == pytest.approx(eager["loss"], rel=1e-4, abs=1e-6)
        assert fast["reward/mean"] == pytest.approx(eager["reward/mean"], rel=1e-4, abs=1e-6)
