"""DanceGRPO's sampling settings: the fixed time shift (``sampling.sigma_shift``), one
initial noise per group (``rollout.same_noise``) and the last step sampled but never
trained (``objective.skip_last_step``)."""

import torch

from diffrl.config import load_config
from diffrl.models import build_adapter
from diffrl.sampling import SamplerSettings, rollout_independent
from diffrl.sampling.schedule import shifted_grid
from diffrl.training.trainer import Trainer
from tests.helpers import quick_config


def test_the_fixed_shift_is_dancegrpo_s_sd3_time_shift():
    """s t / (1 + (s - 1) t) at t = 1, 3/4, 1/2, 1/4, 0 with s = 3, worked by hand."""
    expected = torch.tensor([1.0, 9 / 10, 3 / 4, 1 / 2, 0.0])
    assert torch.allclose(shifted_grid(4, 3.0), expected)
    assert torch.equal(shifted_grid(4, 1.0), torch.linspace(1, 0, 5))


def _rollout(*overrides, keys=None):
    cfg = load_config("tiny_toy_flowgrpo", ["sampling.num_steps=4", *overrides])
    adapter = build_adapter(cfg.model)
    keys = keys or [(cfg.seed, 0, p, s) for p in range(2) for s in range(3)]
    cond = adapter.encode_prompts(["a red circle"] * len(keys))
    return rollout_independent(adapter, adapter.transformer, cond, keys, cfg), keys


def test_rollouts_step_through_the_shifted_grid():
    traj, _ = _rollout("sampling.sigma_shift=3.0")
    assert torch.allclose(traj.sigmas, shifted_grid(4, 3.0))
    plain, _ = _rollout()
    assert not torch.allclose(plain.sigmas, traj.sigmas)


def test_a_group_shares_its_initial_noise_and_nothing_else():
    traj, keys = _rollout("rollout.same_noise=true")
    x0 = traj.latents[:, 0]
    for p in range(2):
        rows = [i for i, k in enumerate(keys) if k[2] == p]
        assert all(torch.equal(x0[rows[0]], x0[r]) for r in rows)
        assert not torch.equal(
            traj.latents[rows[0], -1], traj.latents[rows[1], -1]
        )  # the SDE tells them apart
    assert not torch.equal(x0[0], x0[3])  # another prompt, another noise
    independent, _ = _rollout()
    assert not torch.equal(independent.latents[0, 0], independent.latents[1, 0])
    assert torch.equal(
        independent.latents[0, 0], traj.latents[0, 0]
    )  # the group's noise is its first sample's
    cfg = load_config("tiny_toy_flowgrpo", ["rollout.same_noise=true"])
    assert SamplerSettings.of(cfg).same_noise


def test_evaluations_keep_one_noise_per_seed(tmp_path):
    reward = 'rewards=[{"name": "jpeg_compressibility", "weight": 1.0}]'
    shared = Trainer(
        quick_config("tiny_toy_flowgrpo", tmp_path / "a", "rollout.same_noise=true", reward, "eval.every=1")
    ).evaluate()
    own = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path / "b", reward, "eval.every=1")).evaluate()
    assert shared == own


def test_the_last_step_is_sampled_but_never_trained(tmp_path):
    seen = {}
    for skip in (False, True):
        trainer = Trainer(
            quick_config(
                "tiny_toy_flowgrpo",
                tmp_path / str(skip),
                "train.max_steps=1",
                f"objective.skip_last_step={str(skip).lower()}",
            )
        )
        steps, real = set(), trainer.updater._step_batch

        def spy(traj, cond, advantages, p, real=real, steps=steps):
            steps.add(p.t)
            return real(traj, cond, advantages, p)

        trainer.updater._step_batch = spy
        trainer.fit()
        seen[skip] = steps
    assert seen == {False: {0, 1, 2, 3}, True: {0, 1, 2}}
