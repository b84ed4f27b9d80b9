"""objective.detach_uncond (issue 60, item 1): flow_grpo's compute_log_prob detaches the
unconditional prediction under training CFG, so the update follows s * grad(v_cond)
instead of the guided velocity's s * grad(v_cond) - (s - 1) * grad(v_uncond). Checked on
the SD3 twin against the two branches' own gradients, each computed alone."""

from __future__ import annotations

import torch

from diffrl.config import load_config
from diffrl.models import build_adapter
from diffrl.models.base import Conditioning
from diffrl.models.policy import Policy
from diffrl.perf.flops import velocity_inputs

SCALE = 4.5


def _grads(policy, loss) -> torch.Tensor:
    params = policy.trainable_parameters()
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def test_detached_uncond_trains_the_conditional_branch_only():
    cfg = load_config("tiny_sd3_flowgrpo", [f"model.guidance_scale={SCALE}"])
    adapter = build_adapter(cfg.model)
    policy = Policy(adapter, cfg.model, cfg.seed)
    with torch.no_grad():  # LoRA B starts at 0; move it so both factors carry gradient
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    torch.manual_seed(0)
    x, sigma, cond = velocity_inputs(adapter, 2)
    assert all(f"negative_{k}" in cond.tensors for k in adapter.cond_keys)  # CFG runs
    model = adapter.transformer
    uncond = Conditioning({k: cond.tensors[f"negative_{k}"] for k in adapter.cond_keys})

    def branch(c):  # one branch alone: its velocity without guidance
        return adapter.velocity(model, x, sigma, c, guidance=False).sum()

    g_cond, g_uncond = _grads(policy, branch(cond)), _grads(policy, branch(uncond))
    detached = _grads(policy, adapter.velocity(model, x, sigma, cond, detach_uncond=True).sum())
    full = _grads(policy, adapter.velocity(model, x, sigma, cond).sum())
    torch.testing.assert_close(detached, SCALE * g_cond, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(full, SCALE * g_cond - (SCALE - 1) * g_uncond, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(detached, full, rtol=1e-3, atol=1e-4)  # the two updates differ
    with torch.no_grad():  # and the value itself does not move
        same = adapter.velocity(model, x, sigma, cond, detach_uncond=True)
        torch.testing.assert_close(same, adapter.velocity(model, x, sigma, cond), rtol=0, atol=0)
