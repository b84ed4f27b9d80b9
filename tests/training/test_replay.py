"""Invariants of rollout + replay on every tiny family: on-policy ratio is 1, KL is 0
before any update, and rollouts do not depend on how samples are batched."""

import pytest
import torch

from diffrl.algorithms.flow_grpo import flow_grpo_loss
from diffrl.algorithms.objective import LossContext, StepBatch
from diffrl.models import build_adapter
from diffrl.models.policy import Policy
from diffrl.sampling.rollout import rollout_independent
from tests.conftest import FAMILIES
from tests.helpers import family_prompts


def _setup(cfg, perturb_lora: bool):
    adapter = build_adapter(cfg.model)
    policy = Policy(adapter, cfg.model)
    if perturb_lora:  # make the adapter matter, so the replay exercises LoRA layers too
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in policy.trainable_named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return adapter, policy


def _replay(adapter, policy, cfg, traj, cond, t, kl_coef=0.0):
    ocfg = cfg.objective
    ocfg.kl_coef = kl_coef

    def pv(x, s, c):
        return adapter.velocity(adapter.transformer, x, s, c)

    def rv(x, s, c):
        with policy.reference() as ref:
            return adapter.velocity(ref, x, s, c)

    ctx = LossContext(pv, rv, ocfg, cfg.sampling.noise_level)
    batch = StepBatch(
        traj.latents[:, t],
        traj.latents[:, t + 1],
        traj.sigmas[t],
        traj.sigmas[t + 1],
        float(traj.sigmas[1]),
        traj.step_kinds[t],
        traj.log_probs[:, t],
        torch.ones(len(traj.keys)),
        cond,
    )
    with torch.no_grad():
        return flow_grpo_loss(ctx, batch)


def _keys(n):
    return [(0, 0, i // 2, i % 2) for i in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_on_policy_ratio_is_one(family, tiny_cfg):
    cfg = tiny_cfg(family)
    adapter, policy = _setup(cfg, perturb_lora=True)
    prompts = ["a red circle", "a red circle", "two blue squares", "two blue squares"]
    cond = adapter.encode_prompts(family_prompts(family, prompts))
    traj = rollout_independent(adapter, adapter.transformer, cond, _keys(4), cfg)
    assert traj.trainable_steps() == list(range(cfg.sampling.num_steps))
    for t in traj.trainable_steps():
        _, stats = _replay(adapter, policy, cfg, traj, cond, t)
        assert abs(stats["ratio"].item() - 1.0) < 1e-5, (family, t, stats["ratio"].item())


@pytest.mark.parametrize("family", FAMILIES)
def test_kl_is_zero_before_any_update(family, tiny_cfg):
    cfg = tiny_cfg(family)
    adapter, policy = _setup(cfg, perturb_lora=False)
    cond = adapter.encode_prompts(family_prompts(family, ["a cat", "a cat"]))
    traj = rollout_independent(adapter, adapter.transformer, cond, _keys(2), cfg)
    _, stats = _replay(adapter, policy, cfg, traj, cond, 1, kl_coef=1.0)
    assert stats["kl"].item() == 0.0


def test_kl_is_positive_once_policy_differs(tiny_cfg):
    cfg = tiny_cfg("flux")
    adapter, policy = _setup(cfg, perturb_lora=True)
    cond = adapter.encode_prompts(["a cat", "a cat"])
    traj = rollout_independent(adapter, adapter.transformer, cond, _keys(2), cfg)
    _, stats = _replay(adapter, policy, cfg, traj, cond, 1, kl_coef=1.0)
    assert stats["kl"].item() > 0.0


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_rollout_does_not_depend_on_chunking(family, tiny_cfg):
    cfg = tiny_cfg(family)
    adapter, _ = _setup(cfg, perturb_lora=True)
    prompts = ["a cat", "a cat", "a dog", "a dog"]
    cond = adapter.encode_prompts(prompts)
    cfg.rollout.batch_size = 4
    whole = rollout_independent(adapter, adapter.transformer, cond, _keys(4), cfg, keep_noise=True)
    cfg.rollout.batch_size = 1
    single = rollout_independent(adapter, adapter.transformer, cond, _keys(4), cfg, keep_noise=True)
    torch.testing.assert_close(whole.latents, single.latents, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole.log_probs, single.log_probs, atol=1e-5, rtol=1e-5)
    assert torch.equal(whole.step_noise, single.step_noise)


def test_replay_of_stored_noise_reproduces_sample(tiny_cfg):
    """Exact replay: stepping again with the stored per-step noise gives the same latents."""
    from diffrl.sampling.sde import step

    cfg = tiny_cfg("flux")
    adapter, _ = _setup(cfg, perturb_lora=True)
    cond = adapter.encode_prompts(["a cat", "a dog"])
    traj = rollout_independent(adapter, adapter.transformer, cond, _keys(2), cfg, keep_noise=True)
    x = traj.latents[:, 0]
    with torch.no_grad():
        for t in range(traj.num_steps):
            v = adapter.velocity(adapter.transformer, x, traj.sigmas[t].expand(2), cond)
            x = step(
                traj.step_kinds[t],
                x,
                v,
                traj.sigmas[t],
                traj.sigmas[t + 1],
                cfg.sampling.noise_level,
                sigma_1=float(traj.sigmas[1]),
                noise=traj.step_noise[:, t],
            ).next_latents
    torch.testing.assert_close(x, traj.latents[:, -1], atol=1e-6, rtol=0)


def test_joining_chunks_consumes_them_field_by_field(tiny_cfg):
    """rollout_independent joins its chunks with consume=True: the result equals a plain
    join, and each chunk's tensors are released as their field is joined, so the join
    never holds two copies of the iteration's trajectories (issue 37, defect 6)."""
    from diffrl.sampling.rollout import Trajectory

    cfg = tiny_cfg("flux")
    adapter, _ = _setup(cfg, perturb_lora=False)
    cond = adapter.encode_prompts(["a cat"] * 4)
    whole = rollout_independent(adapter, adapter.transformer, cond, _keys(4), cfg, keep_noise=True)
    parts = [whole.select([0, 1]), whole.select([2, 3])]
    plain = Trajectory.cat(parts)
    joined = Trajectory.cat(parts, consume=True)
    for name in ("latents", "means", "log_probs", "stds", "step_noise", "images"):
        assert torch.equal(getattr(joined, name), getattr(plain, name)), name
        assert all(getattr(p, name) is None for p in parts), name
    assert joined.keys == whole.keys and joined.nfe == plain.nfe


def test_training_rollouts_do_not_keep_their_noise(tiny_cfg):
    """Nothing in an update reads the per-step noise, so a rollout stores none of it (it
    was a third of a pool's trajectory memory, zeros at every ODE step included)."""
    cfg = tiny_cfg("flux")
    adapter, _ = _setup(cfg, perturb_lora=True)
    cond = adapter.encode_prompts(["a cat", "a dog"])
    lean = rollout_independent(adapter, adapter.transformer, cond, _keys(2), cfg)
    kept = rollout_independent(adapter, adapter.transformer, cond, _keys(2), cfg, keep_noise=True)
    assert lean.step_noise is None
    assert kept.step_noise.shape == (2, kept.num_steps, *adapter.latent_shape())
    assert torch.equal(lean.latents, kept.latents)  # the same draws either way
