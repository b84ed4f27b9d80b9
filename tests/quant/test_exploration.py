"""The exploration copy: LoRA merged, keep-high patterns, and a sync that re-quantizes
from the current weights (a stale-scale bug would fail the sync test)."""

import pytest
import torch

from diffrl.config import load_config
from diffrl.models import build_adapter
from diffrl.policy import Policy
from diffrl.quant import fake_nvfp4
from diffrl.quant.exploration import ExplorationCopy, merged_weight


def _policy(family="flux"):
    cfg = load_config(f"tiny_{family}_flowgrpo")
    adapter = build_adapter(cfg.model)
    policy = Policy(adapter, cfg.model)
    return adapter, policy


def _perturb_lora(policy, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _forward(adapter, model, seed=0):
    cond = adapter.encode_prompts(["a red circle", "two cats"])
    x = torch.randn((2, *adapter.latent_shape()), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return adapter.velocity(model, x, torch.tensor([0.7, 0.7]), cond)


def test_bf16_copy_equals_the_lora_policy():
    adapter, policy = _policy()
    _perturb_lora(policy, 0)
    copy = ExplorationCopy(policy.transformer, "bf16")
    assert not any("lora" in n for n, _ in copy.model.named_parameters())
    torch.testing.assert_close(_forward(adapter, copy.model), _forward(adapter, policy.transformer),
                               rtol=1e-5, atol=1e-5)


def test_merged_weight_is_base_plus_scaled_lora_product():
    adapter, policy = _policy()
    _perturb_lora(policy, 1)
    layer = next(m for m in policy.transformer.modules() if hasattr(m, "lora_A"))
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = layer.base_layer.weight + layer.scaling["default"] * b @ a
    torch.testing.assert_close(merged_weight(layer), expected.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
def test_sync_after_a_lora_update_matches_a_fresh_copy(precision):
    adapter, policy = _policy()
    explore = ExplorationCopy(policy.transformer, precision)
    before = _forward(adapter, explore.model)
    _perturb_lora(policy, 2)  # stands for an optimizer step
    explore.sync(policy.transformer)
    fresh = ExplorationCopy(policy.transformer, precision)
    after = _forward(adapter, explore.model)
    assert torch.equal(after, _forward(adapter, fresh.model))
    assert not torch.allclose(after, before)
    name = explore.quantized[0]
    expected = explore.quantize_weight(merged_weight(policy.transformer.get_submodule(name)))
    assert torch.equal(explore.model.get_submodule(name).weight, expected)


def test_keep_high_patterns_are_anchored():
    adapter, policy = _policy()
    explore = ExplorationCopy(policy.transformer, "nvfp4", keep_high=[r"proj_out", r"x_embedder"])
    kept = set(explore.linear_names) - set(explore.quantized)
    assert kept == {"proj_out", "x_embedder"}  # not single_transformer_blocks.N.proj_out
    assert any(n.endswith(".proj_out") for n in explore.quantized)
    w = merged_weight(policy.transformer.get_submodule("proj_out"))
    assert torch.equal(explore.model.get_submodule("proj_out").weight, w)
    name = next(n for n in explore.quantized if n.endswith(".proj_out"))
    assert torch.equal(explore.model.get_submodule(name).weight,
                       fake_nvfp4(merged_weight(policy.transformer.get_submodule(name))))


def test_unknown_precision_is_named():
    adapter, policy = _policy()
    with pytest.raises(ValueError, match="unknown exploration precision 'fp4'"):
        ExplorationCopy(policy.transformer, "fp4")
