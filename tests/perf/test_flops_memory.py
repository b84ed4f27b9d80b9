"""FLOP counts and saved-activation counts against independent references: forward
hooks on every linear layer plus the attention formula, and hand-derived byte counts."""

import torch

from diffrl.models import build_adapter
from diffrl.perf.flops import count_flops, velocity_fn
from diffrl.perf.hardware import spec_peak
from diffrl.perf.memory import saved_activation_bytes


def _linear_flops_by_hooks(model, fn) -> int:
    total = 0

    def hook(module, inputs, output):
        nonlocal total
        rows = inputs[0].numel() // module.in_features
        total += 2 * rows * module.in_features * module.out_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return total


def test_flux_velocity_flops_equal_linear_layers_plus_attention(tiny_cfg):
    cfg = tiny_cfg("flux")
    adapter = build_adapter(cfg.model)
    t = adapter.transformer
    batch = 3
    fn = velocity_fn(adapter, t, batch)
    counted = count_flops(fn)
    linear = _linear_flops_by_hooks(t, fn)
    tokens = adapter.latent_shape()[0] + cfg.model.max_sequence_length  # joint attention over image + text
    heads, head_dim = t.config.num_attention_heads, t.config.attention_head_dim
    blocks = t.config.num_layers + t.config.num_single_layers
    attention = blocks * 4 * batch * heads * tokens * tokens * head_dim  # QK^T and AV, 2 FLOPs per MAC
    assert counted == linear + attention


def test_cfg_doubles_the_flops_of_a_cfg_family(tiny_cfg):
    adapter = build_adapter(tiny_cfg("sd3").model)
    with_cfg = count_flops(velocity_fn(adapter, adapter.transformer, 2, guidance=True))
    without = count_flops(velocity_fn(adapter, adapter.transformer, 2, guidance=False))
    assert with_cfg == 2 * without


def test_saved_activations_of_a_two_layer_mlp_match_hand_count():
    n, d, h = 5, 7, 11
    w1 = torch.nn.Parameter(torch.randn(d, h))
    w2 = torch.nn.Parameter(torch.randn(h, 3))
    x = torch.randn(n, d, requires_grad=True)

    def forward():
        return (torch.relu(x @ w1) @ w2).sum()

    # x @ w1 saves x (w1 is a parameter, not counted); relu saves its output, which the
    # second matmul saves too (counted once); the sum saves nothing
    assert saved_activation_bytes(forward) == 4 * (n * d + n * h)


def test_saved_activations_count_on_the_meta_device():
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    w = torch.nn.Parameter(torch.randn(8, 8, device="meta"))
    assert saved_activation_bytes(lambda: torch.tanh(x @ w).sum()) == 4 * (4 * 8 + 4 * 8)


def test_spec_peaks_prefer_the_specific_name():
    assert spec_peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert spec_peak("NVIDIA H100 PCIe") == 756.0e12
    assert spec_peak("NVIDIA H100 NVL") == 835.5e12 and spec_peak("NVIDIA GB200") == 2500e12
    assert spec_peak("NVIDIA H100 80GB HBM3", "float32") is None
    assert spec_peak("cpu (2 threads)") is None
