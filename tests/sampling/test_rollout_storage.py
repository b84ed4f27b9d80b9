"""Why a trajectory stores its latents and means in fp32 even when the model computes in
bf16 (issue 37, defect 6): the old log-prob and the old mean are fp32 functions of the
stored x_t and x_{t+1}, so a bf16 copy of them moves the on-policy log-ratio and KL by
more than the configs' clip range and divergence threshold, though the model itself sees
bf16(x_t) either way."""

import torch

from diffrl.config import load_config
from diffrl.models import build_adapter
from diffrl.sampling.rollout import rollout_independent
from diffrl.sampling.sde import gaussian_kl, step

CLIP_RANGE = 1e-4  # the real flow_grpo configs' ratio clip (sd35_grpo_guard: 2e-6)
DPPO_KL_THRESHOLD = 1e-5  # sd35_flow_dppo's objective.args.kl_threshold


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def test_a_bf16_model_s_trajectory_is_fp32_because_the_on_policy_ratio_needs_it():
    cfg = load_config("tiny_flux_flowgrpo")
    adapter = build_adapter(cfg.model)
    adapter.transformer.to(torch.bfloat16)
    cond = adapter.encode_prompts(["a red circle", "two cats"])
    traj = rollout_independent(adapter, adapter.transformer, cond, [(0, 0, 0, 0), (0, 0, 0, 1)], cfg)
    assert traj.latents.dtype == traj.means.dtype == traj.log_probs.dtype == torch.float32
    level, sigma_1 = cfg.sampling.noise_level, float(traj.sigmas[1])
    moved, kl = [], []
    for t in traj.trainable_steps():
        x, x_next, sigmas = traj.latents[:, t], traj.latents[:, t + 1], traj.sigmas[t : t + 2]
        with torch.no_grad():
            v = adapter.velocity(adapter.transformer, x, sigmas[0].expand(2), cond)
            # the model reads bf16(x_t) whatever is stored: its first layer casts the input
            assert torch.equal(v, adapter.velocity(adapter.transformer, _bf16(x), sigmas[0].expand(2), cond))
        kind = traj.step_kinds[t]
        same = step(kind, x, v, *sigmas, level, sigma_1=sigma_1, next_latents=x_next)
        assert torch.equal(same.log_prob, traj.log_probs[:, t])  # ratio exactly 1, KL exactly 0
        assert torch.equal(same.mean, traj.means[:, t])
        rounded = step(kind, _bf16(x), v, *sigmas, level, sigma_1=sigma_1, next_latents=_bf16(x_next))
        moved.append((rounded.log_prob - traj.log_probs[:, t]).abs().max().item())
        kl.append(gaussian_kl(same.mean, _bf16(same.mean), same.std, same.std_t).max().item())
    assert max(moved) > CLIP_RANGE  # bf16 latents: the first inner step would already clip
    assert max(kl) > DPPO_KL_THRESHOLD  # bf16 means: DPPO would mask on-policy samples
