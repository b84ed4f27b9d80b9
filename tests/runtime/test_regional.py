"""Regional compilation (diffrl.runtime.regional, issue 50 item 3): one compile per distinct
block whatever the depth, the same numbers as eager, and nothing leaks into copies."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

from diffrl.runtime.regional import RegionalCompile, eager_blocks, repeated_block_classes


class CountingBackend:
    """A torch.compile backend that counts the graphs dynamo hands it and runs them as
    traced (no inductor: the count is what is checked, not the speed)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def flux(depth: int, seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=depth,
        num_single_layers=depth,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    ).eval()


def flux_inputs(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(2, 16, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 4, 16, generator=g),
        "pooled_projections": torch.randn(2, 8, generator=g),
        "timestep": torch.tensor([0.5, 0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(4, 3),
    }


def sd3(depth: int) -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=depth,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        out_channels=4,
        pos_embed_max_size=16,
    ).eval()


def sd3_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(2, 4, 16, generator=g),
        "pooled_projections": torch.randn(2, 8, generator=g),
        "timestep": torch.tensor([500.0, 500.0]),
    }


def graphs_compiled(model, inputs, calls: int = 2) -> int:
    torch._dynamo.reset()
    backend = CountingBackend()
    compiled = RegionalCompile(model, backend=backend, fullgraph=True, log=None)
    with torch.no_grad():
        for _ in range(calls):
            compiled(**inputs)
    assert compiled.failed is None
    return backend.graphs


@pytest.mark.parametrize(
    ("build", "inputs", "shallow", "deep"),
    [(flux, flux_inputs, 2, 6), (sd3, sd3_inputs, 2, 6)],
    ids=["flux-declared-blocks", "sd3-block-list"],
)
def test_the_compile_count_does_not_grow_with_depth(build, inputs, shallow, deep):
    """FLUX declares its blocks to diffusers; SD3 does not, and its block list is found."""
    few = graphs_compiled(build(shallow), inputs())
    many = graphs_compiled(build(deep), inputs())
    assert few == many
    # one graph per block class, plus at most one per class for a first block whose input
    # has another layout (FLUX's first single block receives a concatenation)
    classes = len(repeated_block_classes(build(1)))
    assert classes <= many <= 2 * classes


def test_the_block_classes_come_from_the_declaration_or_the_block_lists():
    assert repeated_block_classes(flux(1)) == ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    assert getattr(SD3Transformer2DModel, "_repeated_blocks", None) in (None, [], ())
    assert repeated_block_classes(sd3(2)) == ("JointTransformerBlock",)
    with pytest.raises(ValueError, match="no repeated blocks"):
        RegionalCompile(torch.nn.Linear(2, 2), log=None)


def test_compiled_blocks_compute_what_eager_blocks_compute_and_see_weight_updates():
    model, inputs = flux(3), flux_inputs()
    with torch.no_grad():
        eager = model(**inputs).sample
    torch._dynamo.reset()
    compiled = RegionalCompile(model, backend="inductor", fullgraph=True, log=None)
    with torch.no_grad():
        first = compiled(**inputs).sample
        assert compiled.failed is None
        torch.testing.assert_close(first, eager, rtol=1e-4, atol=1e-5)
        for p in model.single_transformer_blocks[1].parameters():  # an update, in place
            p.mul_(1.5)
        updated = compiled(**inputs).sample
        model_copy = copy.deepcopy(model)  # eager: the copy's blocks have no compiled call
        reference = model_copy(**inputs).sample
    assert not torch.allclose(updated, first)
    torch.testing.assert_close(updated, reference, rtol=1e-4, atol=1e-5)


def test_a_copy_runs_its_own_weights_not_the_compiled_original_s():
    """Exploration copies and KL references are deep copies of the policy: a compiled
    call copied along would run the policy's weights in the copy."""
    model, inputs = flux(2), flux_inputs()
    RegionalCompile(model, backend=CountingBackend(), log=None)
    twin = copy.deepcopy(model)
    assert all(b._compiled_call_impl is None for b in twin.modules() if hasattr(b, "_compiled_call_impl"))
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
        assert twin(**inputs).sample.abs().max() == 0


def test_inference_only_blocks_train_eagerly():
    """The training policy's blocks: compiled for rollouts (no gradients), eager in the
    training forward (gradient checkpointing and hooks as before)."""
    torch._dynamo.reset()
    backend = CountingBackend()
    model, inputs = flux(2), flux_inputs()
    compiled = RegionalCompile(model, backend=backend, inference_only=True, log=None)
    compiled(**inputs).sample.sum().backward()  # training: eager
    assert backend.graphs == 0
    assert model.transformer_blocks[0].attn.to_q.weight.grad is not None
    with torch.no_grad():
        compiled(**inputs)
    assert backend.graphs >= 2


def test_the_update_s_gradient_free_forwards_run_eagerly_too():
    """Inside eager_blocks (the update: its KL reference, its old policy) a no-gradient
    call runs the eager blocks, so it is computed as the policy's training forward is."""
    torch._dynamo.reset()
    backend = CountingBackend()
    model, inputs = flux(2), flux_inputs()
    compiled = RegionalCompile(model, backend=backend, inference_only=True, log=None)
    with torch.no_grad(), eager_blocks():
        compiled(**inputs)
    assert backend.graphs == 0
    with torch.no_grad():  # the rollouts, outside it
        compiled(**inputs)
    assert backend.graphs >= 2


def test_a_failed_compile_says_so_once_and_runs_eagerly():
    def broken(gm, example_inputs):
        raise RuntimeError("no C++ compiler")

    torch._dynamo.reset()
    lines = []
    model, inputs = flux(2), flux_inputs()
    with torch.no_grad():
        eager = model(**inputs).sample
        compiled = RegionalCompile(model, backend=broken, log=lines.append, label="perf.compile_rollout")
        out = compiled(**inputs).sample
        compiled(**inputs)
    torch.testing.assert_close(out, eager)
    assert compiled.failed is not None and "no C++ compiler" in compiled.failed
    assert len(lines) == 1 and lines[0].startswith("perf.compile_rollout: compiling FluxTransformer2DModel")


def test_the_compile_time_counts_the_first_compiled_calls_whoever_made_them():
    """An evaluation before the first rollout calls the policy's blocks first: the
    compile time the rollout model reports still holds that compilation."""
    torch._dynamo.reset()
    model, inputs, lines = flux(2), flux_inputs(), []
    compiled = RegionalCompile(model, backend=CountingBackend(), inference_only=True, log=lines.append)
    with torch.no_grad():
        model(**inputs)  # in place: the module's own call compiles its blocks
        spent = compiled.compile_s
        compiled(**inputs)
    assert spent > 0 and compiled.compile_s == spent  # the later call added nothing
    assert len(lines) == 1 and f"first calls {spent:.1f} s, compiling included" in lines[0]
    assert lines[0].startswith(
        "compile: 4 blocks of 2 kinds (FluxTransformerBlock, FluxSingleTransformerBlock)"
    )
