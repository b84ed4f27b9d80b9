"""The velocity anchor on untrained steps: its loss against the formula, its pass plan
(the policy passes are unchanged, anchor passes only on untrained steps), and a short
run where it keeps the untrained steps closer to the reference than no anchor does.
The same for trees is in tests/algorithms/test_tree_anchor.py."""

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from diffrl.algorithms.anchor import anchor_loss
from diffrl.algorithms.objective import LossContext, StepBatch
from diffrl.config import ConfigError, load_config
from diffrl.training.passes import sample_major
from diffrl.training.trainer import Trainer


def test_anchor_loss_is_coef_times_mean_squared_velocity_gap_with_no_gradient_into_the_reference():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0], [2.0, 2.0, 2.0]])
    w = torch.tensor(1.5, requires_grad=True)
    r = torch.tensor(0.5, requires_grad=True)
    ctx = LossContext(
        policy_velocity=lambda x, s, c: w * x,
        reference_velocity=lambda x, s, c: r * x + 1.0,
        objective_cfg=SimpleNamespace(anchor_coef=0.3),
        noise_level=0.7,
    )
    weights = torch.tensor([1.0, 0.0, 1.0])  # the middle sample is masked out
    batch = StepBatch(
        x_t=x,
        x_next=x,
        sigma=torch.tensor(0.2),
        sigma_next=torch.tensor(0.1),
        sigma_1=None,
        kind="ode",
        old_log_prob=torch.zeros(3),
        advantages=torch.zeros(3),
        cond=None,
        weights=weights,
    )
    loss, stats = anchor_loss(ctx, batch)
    rows = [[(1.5 * a - (0.5 * a + 1.0)) ** 2 for a in row] for row in x.tolist()]
    per_sample = [sum(row) / 3 for row in rows]
    expected = 0.3 * (per_sample[0] + per_sample[2]) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["anchor/drift"].item() == pytest.approx(expected / 0.3, rel=1e-6)
    loss.backward()
    assert w.grad is not None and w.grad.abs() > 0 and r.grad is None


def test_anchor_passes_leave_the_policy_plan_unchanged_and_cover_only_untrained_steps():
    cfg = load_config(
        "toy_flowgrpo",
        [
            "train.micro_batch_size=16",
            "train.gradient_accumulation=2",
            "objective.anchor_coef=1.0",
            "objective.anchor_fraction=0.34",
        ],
    )
    trainable, untrained = [0, 1, 2, 3], [4, 5, 6, 7, 8, 9]
    plain = sample_major(64, trainable, cfg, 5, 1)
    anchored = sample_major(64, trainable, cfg, 5, 1, untrained)
    assert len(plain) == len(anchored)
    for p_group, a_group in zip(plain, anchored):
        policy = [p for p in a_group if not p.anchor]
        anchors = [p for p in a_group if p.anchor]
        assert [(p.rows, p.t, p.share) for p in policy] == [(p.rows, p.t, p.share) for p in p_group]
        assert sum(Fraction(*p.share) for p in policy) == 1 and sum(Fraction(*p.share) for p in anchors) == 1
        assert {p.t for p in anchors} <= set(untrained)
        per_micro_batch = math.ceil(0.34 * len(untrained))
        assert len(anchors) == 2 * per_micro_batch  # two accumulated micro-batches


def test_anchor_is_accepted_on_trees_for_transition_objectives_only_and_bad_values_are_rejected():
    assert load_config("toy_branchgrpo", ["objective.anchor_coef=1.0"]).objective.anchor_coef == 1.0
    # a clean-sample objective trains a tree's leaves as independent samples: no edge plan to anchor
    with pytest.raises(ConfigError, match="anchor_coef on trees needs a transition objective"):
        load_config("toy_branchgrpo", ["objective.anchor_coef=1.0", "objective.name=nft"])
    with pytest.raises(ConfigError, match="anchor_fraction"):
        load_config("toy_flowgrpo", ["objective.anchor_fraction=0"])


def _untrained_drift(anchor_coef: float, tmp_path) -> tuple[float, list[dict]]:
    """Train 3 iterations with the SDE on step 0 only and a large learning rate, then
    measure ||v_theta - v_ref||^2 at the untrained steps on fixed random states."""
    # the shipped ShapeWorld model: its rewards vary within a group (a random twin's are all 0)
    cfg = load_config(
        "toy_flowgrpo",
        [
            f"output_dir={tmp_path / str(anchor_coef)}",
            "train.max_steps=3",
            "eval.every=0",
            "eval.at_start=false",
            "checkpoint.every=0",
            "logging.progress_bar=false",
            "sampling.num_steps=4",
            "sampling.sde_window=[0,1]",
            "rollout.prompts_per_step=2",
            "rollout.group_size=8",
            "rollout.batch_size=16",
            "train.micro_batch_size=16",
            "train.num_inner_epochs=2",
            "optim.lr=0.01",
            "optim.warmup_steps=0",
            "objective.clip_range=0.2",
            "objective.anchor_fraction=1.0",
            f"objective.anchor_coef={anchor_coef}",
        ],
    )
    trainer = Trainer(cfg)
    history = trainer.fit()
    adapter, sigmas = trainer.adapter, trainer.adapter.sigmas(cfg.sampling.num_steps)
    cond = adapter.encode_prompts(["two red circles", "a blue square above a green circle"])
    x = torch.randn(2, *adapter.latent_shape(), generator=torch.Generator().manual_seed(0))
    drift = 0.0
    with torch.no_grad():
        for t in range(1, cfg.sampling.num_steps):
            s = sigmas[t].expand(2)
            v = adapter.velocity(trainer.model, x, s, cond)
            with trainer.policy.reference() as ref:
                v_ref = adapter.velocity(ref, x, s, cond)
            drift += float((v - v_ref).pow(2).mean())
    return drift, history


def test_anchor_keeps_the_untrained_steps_closer_to_the_reference(tmp_path):
    free, _ = _untrained_drift(0.0, tmp_path)
    anchored, history = _untrained_drift(100.0, tmp_path)
    assert "anchor/drift" in history[-1]
    assert free > 0
    assert anchored < 0.5 * free
