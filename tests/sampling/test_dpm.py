"""DPM-Solver++(2M), DiffusionNFT's rollout sampler (``sampling.ode_solver: dpm2``),
against diffusers' DPMSolverMultistepScheduler (data prediction, order 2, flow sigmas,
the last step first-order), an independent implementation of the same method."""

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from diffrl.config import ConfigError, load_config
from diffrl.models import build_adapter
from diffrl.sampling import SamplerSettings, rollout_independent
from diffrl.sampling.dpm import DPM2, euler


def _gaussian_velocity(x, sigma, s2=0.09):
    """The exact flow-matching velocity for data N(0, s2): E[noise - x0 | x_sigma]."""
    return (sigma - (1 - sigma) * s2) / ((1 - sigma) ** 2 * s2 + sigma**2) * x


@pytest.mark.parametrize("steps", [10, 25])
def test_dpm2_is_diffusers_dpm_solver_plus_plus_2m(steps):
    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        flow_shift=3.0,
        solver_order=2,
        algorithm_type="dpmsolver++",
        final_sigmas_type="zero",
    )
    scheduler.set_timesteps(steps)
    sigmas = scheduler.sigmas.double()
    x1 = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    theirs, ours, solver = x1.clone(), x1.clone(), DPM2(steps)
    for i, t in enumerate(scheduler.timesteps):
        theirs = scheduler.step(_gaussian_velocity(theirs, float(sigmas[i])), t, theirs).prev_sample
        ours = solver.step(
            i, ours, _gaussian_velocity(ours, float(sigmas[i])), float(sigmas[i]), float(sigmas[i + 1])
        )
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    euler_path = x1.clone()
    for i in range(steps):
        euler_path = euler(
            euler_path, _gaussian_velocity(euler_path, float(sigmas[i])), sigmas[i], sigmas[i + 1]
        )
    assert not torch.allclose(euler_path, ours, atol=1e-3)  # second order is another path


def test_the_first_and_last_steps_are_euler_steps():
    x, v = torch.randn(2, 5), torch.randn(2, 5)
    solver = DPM2(3)
    assert torch.equal(solver.step(0, x, v, 0.9, 0.7), euler(x, v, 0.9, 0.7))
    middle = solver.step(1, x, v, 0.7, 0.4)
    assert not torch.allclose(middle, euler(x, v, 0.7, 0.4))
    assert torch.equal(solver.step(2, x, v, 0.4, 0.0), euler(x, v, 0.4, 0.0))
    # from sigma = 1 (alpha 0) the second step has r infinite: first order, as the reference
    at_one = DPM2(3)
    at_one.step(0, x, v, 1.0, 0.7)
    assert torch.allclose(at_one.step(1, x, v, 0.7, 0.4), euler(x, v, 0.7, 0.4), atol=1e-6)


def test_rollouts_take_dpm2_steps_and_evaluations_euler_steps():
    cfg = load_config(
        "tiny_toy_flowgrpo",
        ["sampling.num_steps=5", "sampling.sde_type=ode", "sampling.ode_solver=dpm2", "objective.name=nft"],
    )
    adapter = build_adapter(cfg.model)
    keys = [(0, 0, 0, s) for s in range(2)]
    cond = adapter.encode_prompts(["a red circle"] * 2)
    dpm = rollout_independent(adapter, adapter.transformer, cond, keys, cfg)
    plain = rollout_independent(
        adapter, adapter.transformer, cond, keys, SamplerSettings.of(cfg).for_evaluation()
    )
    assert torch.isfinite(dpm.latents).all() and not torch.allclose(dpm.latents[:, -1], plain.latents[:, -1])
    assert torch.equal(dpm.latents[:, 1], plain.latents[:, 1])  # the first step is Euler's in both
    assert SamplerSettings.of(cfg).for_evaluation().sampling.ode_solver == "euler"


def test_dpm2_needs_deterministic_independent_rollouts():
    with pytest.raises(ConfigError, match="dpm2 is a multistep solver"):
        load_config("tiny_toy_flowgrpo", ["sampling.ode_solver=dpm2"])  # the config's steps are SDE steps
