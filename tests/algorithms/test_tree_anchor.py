"""The velocity anchor on BranchGRPO trees: anchor passes on the nodes at the ODE steps
only, none counted for a tree whose loss is masked, the edge passes unchanged, one pass
structure for differently shaped sub-trees once padded, and a short run where it keeps
the untrained steps closer to the reference than no anchor does."""

import tempfile
from fractions import Fraction

import torch

import diffrl.training.update as update
from diffrl.config import load_config
from diffrl.sampling import TreeSpec
from diffrl.training.passes import add_tree_anchors, edge_major, tree_anchor_counts
from diffrl.training.trainer import Trainer

# 5 steps, the SDE on steps 0-2 with a split at each (8 leaves), steps 3 and 4 ODE: the
# untrained steps. The shipped ShapeWorld model: a random twin's rewards are all 0, so
# nothing would train. Seed 2: both trees have reward variance at the first iteration.
TREE = [
    "sampling.num_steps=5",
    "sampling.sde_window=[0,3]",
    "tree.split_steps=[0,1,2]",
    "rollout.prompts_per_step=2",
    "rollout.group_size=8",
    "rollout.batch_size=32",
    "train.micro_batch_size=8",
    "train.num_inner_epochs=2",
    "objective.clip_range=0.2",
    "objective.anchor_fraction=1.0",
    "seed=2",
]
ODE_STEPS = [3, 4]


def _cfg(*overrides):
    return load_config("toy_branchgrpo", [*TREE, *overrides])


def _run(anchor_coef: float, *overrides) -> Trainer:
    """One iteration (4 optimizer steps) of the small tree at learning rate 0.01."""
    cfg = _cfg(
        f"output_dir={tempfile.mkdtemp()}",
        "train.max_steps=1",
        "eval.every=0",
        "eval.at_start=false",
        "checkpoint.every=0",
        "logging.progress_bar=false",
        "logging.trackers=[]",
        "optim.lr=0.01",
        "optim.warmup_steps=0",
        f"objective.anchor_coef={anchor_coef}",
        *overrides,
    )
    trainer = Trainer(cfg)
    trainer.history = trainer.fit()
    return trainer


def _spy(monkeypatch) -> dict:
    """Record the update's trajectory and credit, every optimizer step's passes, and the
    batches the anchor loss sees; mask tree 0 out of the loss (as a dropped tree is)."""
    seen = {"passes": [], "batches": []}
    run, step, loss = update.Updater.run, update.Updater._optimizer_step, update.anchor_loss
    tree_advantages = Trainer.tree_advantages

    def dropped_tree_0(self, r, it):
        credit = tree_advantages(self, r, it)
        credit.keep[r.traj.tree == 0] = False
        return credit

    def spy_run(self, traj, cond, credit, it):
        seen.update(traj=traj, credit=credit, step=it, settings=self.settings)
        return run(self, traj, cond, credit, it)

    def spy_step(self, ctx, traj, cond, advantages, passes, totals, epoch):
        seen["passes"].append((epoch, list(passes)))
        return step(self, ctx, traj, cond, advantages, passes, totals, epoch)

    def spy_loss(ctx, batch):
        seen["batches"].append((batch.x_t.detach().clone(), batch.sigma, batch.weights))
        return loss(ctx, batch)

    monkeypatch.setattr(Trainer, "tree_advantages", dropped_tree_0)
    monkeypatch.setattr(update.Updater, "run", spy_run)
    monkeypatch.setattr(update.Updater, "_optimizer_step", spy_step)
    monkeypatch.setattr(update, "anchor_loss", spy_loss)
    return seen


def test_tree_anchor_passes_use_untrained_steps_of_kept_trees_and_leave_edge_passes_alone(monkeypatch):
    seen = _spy(monkeypatch)
    trainer = _run(1.0)
    assert "anchor/drift" in trainer.history[-1] and trainer.history[-1]["anchor/drift"] > 0
    traj, credit = seen["traj"], seen["credit"]
    assert [t for t, k in enumerate(traj.step_kinds) if k == "ode"] == ODE_STEPS
    anchors = [p for _, group in seen["passes"] for p in group if p.anchor]
    assert len(anchors) == len(seen["batches"]) > 0
    counted = []
    for p, (x_t, sigma, weights) in zip(anchors, seen["batches"], strict=True):
        rows = torch.as_tensor(p.rows)
        assert p.t in ODE_STEPS and (traj.depth[rows] == p.t + 1).all()
        assert torch.equal(x_t, traj.latents[traj.parent[rows]])  # x_t: the node at the ODE step
        assert sigma == traj.sigmas[p.t]
        assert weights.tolist() == [float(traj.tree[r] != 0) for r in p.rows]  # tree 0 is masked
        counted += [r for r, w in zip(p.rows, weights.tolist()) if w]
    # anchor_fraction 1: every node of tree 1 at each ODE step, once per epoch
    expected = torch.nonzero(torch.isin(traj.depth - 1, torch.tensor(ODE_STEPS)) & (traj.tree == 1))
    assert sorted(counted) == sorted(expected.flatten().tolist() * 2)
    for _, group in seen["passes"]:
        assert sum(Fraction(*p.share) for p in group if p.anchor) == 1  # normalised apart
    s = seen["settings"].passes
    for epoch in (0, 1):  # the edge passes are edge_major's, as without the anchor
        plain = edge_major(credit.edges, traj.depth, traj.num_leaves, s, seen["step"], epoch, credit.keep)
        mine = [[p for p in group if not p.anchor] for e, group in seen["passes"] if e == epoch]
        assert [[(p.rows, p.t, p.share, p.counted) for p in g] for g in mine] == [
            [(p.rows, p.t, p.share, p.counted) for p in g] for g in plain
        ]


def test_padded_tree_anchors_give_sub_trees_one_pass_structure():
    """Two processes with differently shaped sub-trees (Sol-RL): padded to the per-step
    maximum, both get the same anchor passes of the same sizes, dead rows count nowhere,
    and every live row is anchored once."""
    cfg = _cfg("train.micro_batch_size=4", "objective.anchor_fraction=0.5")
    depth = TreeSpec.build(5, [0, 1, 2], [2]).layout(2)["depth"]
    small = depth[(depth < 4) | (torch.arange(len(depth)) % 3 != 0)]  # fewer nodes at depths 4, 5
    counts = [tree_anchor_counts(d, ODE_STEPS, cfg) for d in (depth, small)]
    assert counts[0] != counts[1]
    pad = {t: max(c[t] for c in counts) for t in ODE_STEPS}
    groups = [[], [], []]  # three optimizer steps, of edges not under test
    plans = [add_tree_anchors(groups, d, ODE_STEPS, cfg, 5, 0, pad_to=pad) for d in (depth, small)]
    shape = [[(p.t, len(p.rows), p.share[1] > 0) for p in g] for g in plans[0]]
    assert shape == [[(p.t, len(p.rows), p.share[1] > 0) for p in g] for g in plans[1]]
    for d, plan, count in zip((depth, small), plans, counts):
        live = []
        for g in plan:
            assert all(p.anchor and (d[p.rows] == p.t + 1).all() for p in g)
            flags = [f for p in g for f in (p.counted or [True] * len(p.rows))]
            assert sum(Fraction(*p.share) for p in g) == (1 if any(flags) else 0)
            live += [(p.t, r) for p in g for r, f in zip(p.rows, p.counted or [True] * len(p.rows)) if f]
        assert len(set(live)) == len(live) == sum(count.values())


def _untrained_drift(trainer) -> float:
    """mean ||v_theta - v_ref||^2 at the ODE steps, on fixed random states."""
    adapter, sigmas = trainer.adapter, trainer.adapter.sigmas(trainer.cfg.sampling.num_steps)
    cond = adapter.encode_prompts(["two red circles", "a blue square above a green circle"])
    x = torch.randn(2, *adapter.latent_shape(), generator=torch.Generator().manual_seed(0))
    drift = 0.0
    with torch.no_grad():
        for t in ODE_STEPS:
            s = sigmas[t].expand(2)
            v = adapter.velocity(trainer.model, x, s, cond)
            with trainer.policy.reference() as ref:
                drift += float((v - adapter.velocity(ref, x, s, cond)).pow(2).mean())
    return drift


def test_tree_anchor_keeps_the_untrained_steps_closer_to_the_reference():
    free, anchored = _untrained_drift(_run(0.0)), _untrained_drift(_run(100.0))
    print(f"untrained-step drift: free {free:.4g}, anchored {anchored:.4g}")
    assert free > 0
    assert anchored < 0.3 * free
