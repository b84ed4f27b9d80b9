"""FLOP counts of the transformer work an RL iteration does, from torch's FlopCounterMode.

The counter sees the matmuls, convolutions and attention kernels actually dispatched
(on any device, meta included), so the count follows the real code path: classifier-free
guidance doubling, the packed/patchified token counts, and for a LoRA step the backward
pass that computes input gradients through the frozen weights but no weight gradients
for them (about 2x the forward, not the 3x of full training).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

PROMPTS = ("a photo of a cat sitting on a table", "two dogs running on the beach")


def benchmark_prompts(adapter, count: int) -> list[str]:
    """``count`` prompts cycling through :data:`PROMPTS`; an editing family (Kontext) gets
    the first shipped ShapeWorld edits instead, which carry their input images."""
    if not adapter.edits_images:
        return [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    from diffrl.data.prompts import PROJECT_ROOT, load_prompts

    edits = load_prompts(PROJECT_ROOT / "assets" / "shapeworld" / "edit" / "train.jsonl")[: len(PROMPTS)]
    return [edits[i % len(edits)] for i in range(count)]


def _counted(op) -> bool:
    """Whether torch's flop registry has a formula for ``op``: keyed by the overload
    (``op.default``) on some builds and by the packet itself on others (2.15)."""
    return op in flop_counter.flop_registry or op.default in flop_counter.flop_registry


def _register_cpu_attention_formulas() -> None:
    """Count CPU attention too. Some torch builds (2.14.1, for one) dispatch CPU SDPA to
    ``_scaled_dot_product_flash_attention_for_cpu``, which has no formula in their flop
    registry, so attention silently counted 0 FLOPs there. Register torch's own SDPA
    formulas for that op and its backward where they are missing; builds that already
    count it are left alone."""
    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None and not _counted(forward):

        @flop_counter.register_flop_formula(forward)
        def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    if backward is not None and not _counted(backward):

        @flop_counter.register_flop_formula(backward)
        def _cpu_sdpa_backward_flops(
            grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
        ) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_attention_formulas()


def count_flops(fn) -> int:
    """Floating-point operations (multiply-add = 2) performed by ``fn()``."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def velocity_inputs(adapter, batch: int, sigma: float = 0.5):
    """Latents, sigmas and conditioning for ``batch`` samples on the adapter's device."""
    device = adapter.device
    cond = adapter.encode_prompts(benchmark_prompts(adapter, batch)).to(device)
    dtype = torch.float32  # the SDE state is fp32; adapters cast to the transformer's dtype
    latents = torch.randn((batch, *adapter.latent_shape()), dtype=dtype, device="cpu").to(device)
    return latents, torch.full((batch,), sigma, device=device), cond


def autocast_context(device, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device``'s type (what training's
    ``train.mixed_precision`` runs under), or nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def velocity_fn(adapter, transformer, batch: int, guidance: bool = True, autocast: torch.dtype | None = None):
    """A closure running one velocity evaluation (with CFG where the family uses it),
    under ``autocast`` when given."""
    latents, sigma, cond = velocity_inputs(adapter, batch)

    def run():
        with torch.no_grad(), autocast_context(latents.device, autocast):
            return adapter.velocity(transformer, latents, sigma, cond, guidance=guidance)

    return run


def train_step_fn(adapter, batch: int, guidance: bool = True, autocast: torch.dtype | None = None):
    """A closure running one training forward + backward of the (LoRA) policy velocity.

    The loss is a stand-in with the flow-GRPO step's shape of work (a policy velocity
    through the transformer and a scalar reduced from it); the reference and old-policy
    forwards that some objectives add are counted separately. ``guidance``: whether the
    loss's velocity applies CFG (``objective.train_cfg``), doubling the rows of CFG families.
    """
    latents, sigma, cond = velocity_inputs(adapter, batch)
    transformer = adapter.transformer

    def run():
        with torch.enable_grad():
            with autocast_context(latents.device, autocast):  # backward runs outside, as training's
                v = adapter.velocity(transformer, latents, sigma, cond, guidance=guidance)
            v.float().square().mean().backward()
        for p in transformer.parameters():
            p.grad = None

    return run
