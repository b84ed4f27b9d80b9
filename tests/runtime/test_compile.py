"""The perf switches: compiled rollouts fall back to eager when compiling fails, and bad
settings are one clear config error."""

import pytest
import torch

from diffrl.config import ConfigError, load_config
from diffrl.models import build_adapter
from diffrl.models.base import unwrap
from diffrl.perf.flops import velocity_inputs
from diffrl.runtime.attention import apply_attention_backend
from diffrl.runtime.compile import CompiledOrEager, compiled


def _perf(**kw):
    return load_config("tiny_flux_flowgrpo", [f"perf.{k}={v}" for k, v in kw.items()]).perf


def test_compile_off_returns_the_module_itself():
    module = torch.nn.Linear(2, 2)
    assert compiled(module, _perf(compile_rollout="false")) is module


def test_a_failed_compile_says_so_once_and_runs_eagerly():
    module = torch.nn.Linear(3, 2)
    lines = []
    wrapped = CompiledOrEager(module, None, log=lines.append)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no working C++ compiler found\nmore detail")

    wrapped._compiled = broken
    x = torch.randn(4, 3)
    assert torch.equal(wrapped(x), module(x)) and torch.equal(wrapped(x), module(x))
    assert len(lines) == 1 and "no working C++ compiler found" in lines[0] and "eagerly" in lines[0]
    assert wrapped.weight is module.weight and unwrap(wrapped) is module  # attributes reach the module


def test_cuda_graphs_need_cuda():
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        compiled(
            torch.nn.Linear(2, 2),
            _perf(compile_rollout="true", compile_mode="reduce-overhead", compile_scope="whole"),
        )


@pytest.fixture
def restore_attention_backend():
    """diffusers' set_attention_backend also switches the process-wide active backend;
    put it back so later tests (the golden runs) see the default numerics."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry, attention_backend

    previous = _AttentionBackendRegistry.get_active_backend()[0]
    with attention_backend(previous):  # diffusers' own context: puts ``previous`` back on exit
        yield
    assert _AttentionBackendRegistry.get_active_backend()[0] == previous


def test_attention_backend_switch_and_its_errors(tiny_cfg, restore_attention_backend):
    adapter = build_adapter(tiny_cfg("flux").model)
    x, sigma, cond = velocity_inputs(adapter, 2)
    with torch.no_grad():
        default = adapter.velocity(adapter.transformer, x, sigma, cond)
        apply_attention_backend(adapter.transformer, "_native_math")
        math = adapter.velocity(adapter.transformer, x, sigma, cond)
    assert torch.allclose(default, math, atol=1e-5)
    with pytest.raises(ConfigError, match="downloads kernels"):
        apply_attention_backend(adapter.transformer, "flash_hub")
    with pytest.raises(ConfigError, match="set perf.attention_backend: null"):
        apply_attention_backend(torch.nn.Linear(2, 2), "flash")
    try:
        import flash_attn  # noqa: F401
    except ImportError:  # the usual CPU machine: diffusers' reason, as one config error
        with pytest.raises(ConfigError, match="perf.attention_backend 'flash': .*flash-attn"):
            apply_attention_backend(adapter.transformer, "flash")


@pytest.mark.parametrize("scope", ["blocks", "whole"])
def test_compiled_rollouts_match_eager_and_follow_weight_updates(tiny_cfg, scope):
    """The real inductor path (on this CPU): the compiled policy agrees with eager, also
    after an in-place update of its LoRA weights (what an optimizer step does). By block,
    the policy's own no-gradient calls run compiled too (in place), so eager is a deep
    copy (which carries no compiled calls)."""
    import copy

    from diffrl.models.policy import Policy

    cfg = tiny_cfg("flux", "perf.compile_rollout=true", f"perf.compile_scope={scope}")
    adapter = build_adapter(cfg.model)
    policy = Policy(adapter, cfg.model)
    lines = []
    fast = compiled(adapter.transformer, cfg.perf, log=lines.append)
    x, sigma, cond = velocity_inputs(adapter, 2)

    def eager():
        return adapter.velocity(copy.deepcopy(adapter.transformer), x, sigma, cond)

    with torch.no_grad():
        before = eager()
        assert torch.allclose(adapter.velocity(fast, x, sigma, cond), before, atol=1e-5)
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn_like(p))
        after = eager()
        assert not torch.allclose(before, after, atol=1e-3)
        assert torch.allclose(adapter.velocity(fast, x, sigma, cond), after, atol=1e-5)
    if scope == "whole":
        assert lines == []  # it compiled: no fallback
    else:  # one line, with the compile time, and no fallback
        assert len(lines) == 1 and "compiled by block; first calls" in lines[0] and fast.failed is None


def test_by_block_rollouts_leave_the_training_forward_eager(tiny_cfg):
    """Gradients flow through the same blocks as before: the training forward of a
    policy compiled for rollouts runs eagerly and gives eager's gradients."""
    import copy

    from diffrl.models.policy import Policy

    cfg = tiny_cfg("flux", "perf.compile_rollout=true", "perf.compile_scope=blocks")
    adapter = build_adapter(cfg.model)
    policy = Policy(adapter, cfg.model)
    twin = copy.deepcopy(adapter.transformer)
    fast = compiled(adapter.transformer, cfg.perf, log=lambda _: None)
    x, sigma, cond = velocity_inputs(adapter, 2)
    with torch.no_grad():
        adapter.velocity(fast, x, sigma, cond)  # compiles the no-gradient path
    adapter.velocity(adapter.transformer, x, sigma, cond).square().sum().backward()
    adapter.velocity(twin, x, sigma, cond).square().sum().backward()
    twin_params = dict(twin.named_parameters())
    for name, p in adapter.transformer.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, twin_params[name].grad)
    assert policy.trainable_parameters()


def test_cuda_graphs_by_block_are_refused():
    """A CUDA-graph replay of one block's graph would overwrite the output of the block
    before it, which is the next block's input."""
    with pytest.raises(ConfigError, match="compile_scope: whole"):
        compiled(
            torch.nn.Linear(2, 2).to("meta"),
            _perf(compile_rollout="true", compile_mode="reduce-overhead", compile_scope="blocks"),
        )


def test_exact_replay_asks_inductor_to_round_as_eager_code_does():
    """perf.exact_replay: inductor's emulate_precision_casts, a mode spelt as its options
    (torch.compile takes one or the other), or the mode alone without it."""
    from diffrl.runtime.compile import compile_kwargs

    assert compile_kwargs(None, exact=False) == {"mode": None}
    assert compile_kwargs(None, exact=True) == {"options": {"emulate_precision_casts": True}}
    autotune = compile_kwargs("max-autotune-no-cudagraphs", exact=True)["options"]
    assert autotune == {
        **torch._inductor.list_mode_options("max-autotune-no-cudagraphs"),
        "emulate_precision_casts": True,
    }
    assert autotune["max_autotune"] is True
    torch.compile(torch.nn.Linear(2, 2), **compile_kwargs("reduce-overhead", exact=True))  # accepted
