"""RLG: w = 0 is the base and w = 1 the aligned model bit for bit; in between and beyond,
the velocity is the affine blend (LoRA toggling on one model, or a second full model)."""

import copy

import pytest
import torch

from diffrl.config import load_config
from diffrl.evaluation.rlg import GuidedTransformer
from diffrl.models import build_adapter
from diffrl.models.policy import Policy


def _lora_policy(name):
    cfg = load_config(name)
    adapter = build_adapter(cfg.model)
    policy = Policy(adapter, cfg.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return adapter, policy


def _velocity(adapter, model):
    cond = adapter.encode_prompts(["a red circle", "two blue squares"])
    x = torch.randn((2, *adapter.latent_shape()), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return adapter.velocity(model, x, torch.tensor([0.6, 0.6]), cond)


@pytest.mark.parametrize("name", ["tiny_flux_flowgrpo", "tiny_toy_flowgrpo", "tiny_sd3_flowgrpo"])
def test_rlg_scales_blend_lora_on_and_off(name):
    adapter, policy = _lora_policy(name)
    aligned = _velocity(adapter, policy.transformer)
    with policy.reference() as ref:
        base = _velocity(adapter, ref)
    assert not torch.allclose(base, aligned)
    assert torch.equal(_velocity(adapter, GuidedTransformer(policy.transformer, 0.0)), base)
    assert torch.equal(_velocity(adapter, GuidedTransformer(policy.transformer, 1.0)), aligned)
    for w in (0.5, 2.0, -0.5):
        torch.testing.assert_close(
            _velocity(adapter, GuidedTransformer(policy.transformer, w)),
            base + w * (aligned - base),
            rtol=1e-4,
            atol=1e-5,
        )
    # the adapters are back on afterwards
    assert torch.equal(_velocity(adapter, policy.transformer), aligned)


def test_rlg_with_a_full_base_model():
    cfg = load_config("tiny_flux_flowgrpo")
    adapter = build_adapter(cfg.model)
    base_model = copy.deepcopy(adapter.transformer)
    with torch.no_grad():
        for p in adapter.transformer.parameters():
            p.add_(0.02)
    aligned, base = _velocity(adapter, adapter.transformer), _velocity(adapter, base_model)
    guided = GuidedTransformer(adapter.transformer, 0.0, base=base_model)
    assert torch.equal(_velocity(adapter, guided), base)
    guided.scale = 1.5
    torch.testing.assert_close(
        _velocity(adapter, guided), base + 1.5 * (aligned - base), rtol=1e-4, atol=1e-5
    )


def test_rlg_needs_lora_or_a_base():
    with pytest.raises(ValueError, match="pass base= for full checkpoints"):
        GuidedTransformer(torch.nn.Linear(2, 2), 0.5)
