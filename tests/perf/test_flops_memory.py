"""FLOP counts and saved-activation counts against independent references: forward
hooks on every linear layer plus the attention formula, and hand-derived byte counts."""

import pytest
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


def test_model_flops_under_checkpointing_match_a_run_without_it(tiny_cfg):
    """The train section counts the recompute as one no-grad forward instead of running
    the step without checkpointing (which ran out of memory at FLUX size): its model
    FLOPs equal a second count taken with checkpointing off, within the few layers
    outside the blocks (issue 37, defect 7)."""
    from diffrl.models import build_adapter
    from diffrl.models.policy import Policy
    from diffrl.perf import bench
    from diffrl.perf.flops import count_flops, train_step_fn

    cfg = tiny_cfg("flux")
    adapter = build_adapter(cfg.model)
    Policy(adapter, cfg.model, cfg.seed)
    adapter.transformer.enable_gradient_checkpointing()
    row = bench.training_step(adapter, 2, repeats=1, dtype=torch.float32)
    adapter.transformer.disable_gradient_checkpointing()
    without = count_flops(train_step_fn(adapter, 2)) / 1e12
    assert row["executed_tflop"] > without  # the recompute ran
    assert row["model_tflop"] == pytest.approx(without, rel=0.1)
    assert row["model_tflop"] <= without  # the overstated recompute errs low, never high


def test_precision_race_compiles_every_model_alike_and_restores_inductor(tiny_cfg, monkeypatch):
    """A ratio must not include compile gains on one side only, and a backend's inductor
    settings must not leak into later compiles (issue 37, defect 7)."""
    import torch._inductor.config as inductor

    from diffrl.models import build_adapter
    from diffrl.perf import bench
    from diffrl.precision import backends

    adapter = build_adapter(tiny_cfg("flux").model)
    compiled, built = [], []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(model) or model)
    real_build = backends.build_exploration_copy

    def build(*args, **kwargs):
        built.append(kwargs.get("compile"))
        inductor.max_autotune = not inductor.max_autotune  # a backend touching global settings
        return real_build(*args, **kwargs)

    monkeypatch.setattr(backends, "build_exploration_copy", build)
    before = inductor.max_autotune
    rows = bench.exploration_precision(
        adapter, ["bf16", "fp8"], 2, 4, repeats=1, log=lambda _: None, compile=True
    )
    assert inductor.max_autotune == before
    assert built == [False, False]  # every copy built eager...
    # ...and both raced models compiled the same way: each of their blocks (the twin has
    # one double and one single), and nothing whole
    kinds = [type(fn.__self__).__name__ for fn in compiled]
    assert sorted(kinds) == ["FluxSingleTransformerBlock"] * 2 + ["FluxTransformerBlock"] * 2
    assert all(r["compiled"] == "by block" and r["first_call_s"] > 0 for r in rows)
