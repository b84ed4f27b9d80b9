"""The exploration copy: LoRA merged, keep-high patterns, and a sync that re-quantizes
from the current weights (a stale-scale bug would fail the sync test)."""

import pytest
import torch

from diffrl.config import load_config
from diffrl.models import build_adapter
from diffrl.models.policy import Policy
from diffrl.precision import fake_nvfp4
from diffrl.precision.exploration import ExplorationCopy, merged_weight


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
    torch.testing.assert_close(
        _forward(adapter, copy.model), _forward(adapter, policy.transformer), rtol=1e-5, atol=1e-5
    )


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
    assert set(explore.kept) == {"proj_out", "x_embedder"}  # not single_transformer_blocks.N.proj_out
    assert any(n.endswith(".proj_out") for n in explore.quantized)
    w = merged_weight(policy.transformer.get_submodule("proj_out"))
    assert torch.equal(explore.model.get_submodule("proj_out").weight, w)
    name = next(n for n in explore.quantized if n.endswith(".proj_out"))
    assert torch.equal(
        explore.model.get_submodule(name).weight,
        fake_nvfp4(merged_weight(policy.transformer.get_submodule(name))),
    )


def test_unknown_precision_is_named():
    adapter, policy = _policy()
    with pytest.raises(ValueError, match="unknown exploration precision 'fp4'"):
        ExplorationCopy(policy.transformer, "fp4")


@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
def test_a_1x1_conv_is_quantized_like_the_equivalent_linear_on_channels_last_input(precision):
    g = torch.Generator().manual_seed(3)
    conv = torch.nn.Conv2d(40, 24, 1)  # 40 channels: two full blocks of 16 and a ragged one
    linear = torch.nn.Linear(40, 24)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(24, 40, 1, 1, generator=g))
        linear.weight.copy_(conv.weight.reshape(24, 40))
        linear.bias.copy_(conv.bias)
    x = torch.randn(3, 40, 5, 6, generator=g) * torch.exp(torch.randn(3, 40, 1, 1, generator=g))
    as_conv = ExplorationCopy(torch.nn.Sequential(conv), precision)
    as_linear = ExplorationCopy(torch.nn.Sequential(linear), precision)
    assert as_conv.quantized == ["0"]
    seen = []
    as_conv.model[0].register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    with torch.no_grad():
        out_conv, out_linear = as_conv.model(x), as_linear.model(x.movedim(1, -1))
    torch.testing.assert_close(out_conv.movedim(1, -1), out_linear, rtol=1e-5, atol=1e-5)
    assert torch.equal(as_conv.model[0].weight.reshape(24, 40), as_linear.model[0].weight)
    if precision == "nvfp4":  # blocks run along the input channels, scales per sample
        assert torch.equal(seen[0], fake_nvfp4(x.movedim(1, -1), per_sample=True).movedim(-1, 1))


def test_other_convs_stay_high():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(16, 16, 3, padding=1, groups=16),
        torch.nn.Conv2d(16, 16, 1, stride=2),
        torch.nn.Conv2d(16, 16, 2),
    )
    explore = ExplorationCopy(model, "nvfp4")
    assert explore.quantizable == [] and explore.layer_names == ["0", "1", "2"]
    for name in explore.layer_names:
        assert torch.equal(explore.model.get_submodule(name).weight, model.get_submodule(name).weight)


def test_sana_copy_merges_the_lora_of_its_1x1_convs():
    adapter, policy = _policy("sana")
    _perturb_lora(policy, 4)
    conv = "transformer_blocks.0.ff.conv_inverted"
    assert hasattr(policy.transformer.get_submodule(conv), "lora_A")  # SANA's LoRA targets its 1x1 convs
    bf16 = ExplorationCopy(policy.transformer, "bf16")
    torch.testing.assert_close(
        _forward(adapter, bf16.model), _forward(adapter, policy.transformer), rtol=1e-5, atol=1e-5
    )
    nvfp4 = ExplorationCopy(policy.transformer, "nvfp4")
    merged = merged_weight(policy.transformer.get_submodule(conv))
    assert torch.equal(
        nvfp4.model.get_submodule(conv).weight,
        fake_nvfp4(merged.reshape(merged.shape[0], -1)).reshape(merged.shape),
    )
    depth = "transformer_blocks.0.ff.conv_depth"
    assert torch.equal(
        nvfp4.model.get_submodule(depth).weight, policy.transformer.get_submodule(depth).weight
    )


def test_sync_loads_biases_of_layers():
    adapter, policy = _policy("sana")
    explore = ExplorationCopy(policy.transformer, "nvfp4")
    with torch.no_grad():  # stands for full fine-tuning, where biases train too
        for module in policy.transformer.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and module.bias is not None:
                module.bias.add_(0.25)
    explore.sync(policy.transformer)
    for name in explore.layer_names:
        bias = explore.model.get_submodule(name).bias
        source = policy.transformer.get_submodule(name)
        if bias is not None:
            assert torch.equal(bias, getattr(source, "base_layer", source).bias)


@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
def test_activation_quantizer_in_chunks_equals_one_piece(precision):
    """Activations are quantized a few samples at a time to bound the reference path's
    fp32 temporaries (issue 37, defect 7); per-sample scales make that exact."""
    from diffrl.precision.exploration import _activation_quantizer

    x = torch.randn(7, 5, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[3] *= 50  # one loud sample: a shared scale would change the others
    whole = _activation_quantizer(precision, chunk_elements=10**9)(x)
    chunked = _activation_quantizer(precision, chunk_elements=2 * 5 * 48)(x)  # 2 samples a chunk
    assert chunked.dtype == x.dtype and torch.equal(whole, chunked)
    assert not torch.equal(whole, x)  # it quantized


def test_min_dim_keeps_the_narrow_layers_high_as_sol_rl_does():
    """solrl.min_quantized_dim: Sol-RL's replace_linear_with_te skips a linear when
    max(in, out) <= nvfp4_min_dim; those layers hold the merged weights as they are."""
    from diffrl.precision.exploration import layer_dims

    _, policy = _policy("sana")  # linears and 1x1 convs of several widths
    _perturb_lora(policy, 0)
    full = ExplorationCopy(policy.transformer, "nvfp4", keep_high=())
    widths = sorted({max(layer_dims(full.model.get_submodule(n))) for n in full.quantized})
    cut = widths[len(widths) // 2 - 1]  # quantize only the wider half
    copy = ExplorationCopy(policy.transformer, "nvfp4", keep_high=(), min_dim=cut)
    assert copy.narrow and sorted(copy.narrow + copy.quantized) == sorted(full.quantized)
    assert all(max(layer_dims(copy.model.get_submodule(n))) > cut for n in copy.quantized)
    assert all(max(layer_dims(copy.model.get_submodule(n))) <= cut for n in copy.narrow)
    source = dict(policy.transformer.named_modules())
    for name in copy.narrow:  # high precision: the merged weight itself
        expected = merged_weight(source[name]).reshape(copy.model.get_submodule(name).weight.shape)
        assert torch.equal(copy.model.get_submodule(name).weight, expected.to(expected.dtype))
    name = copy.quantized[0]  # and the rest still quantized
    weight = copy.model.get_submodule(name).weight
    assert not torch.equal(weight, merged_weight(source[name]).reshape(weight.shape).to(weight.dtype))
