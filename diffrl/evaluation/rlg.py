"""Reinforcement Learning Guidance (RLG): inference-time alignment control ("Inference-Time
Alignment Control for Diffusion Models with Reinforcement Learning Guidance").

The guided prediction blends the base and the aligned model with a scale w:

    out_w = (1 - w) * out_base + w * out_aligned

w = 0 is the base model, w = 1 the aligned one, w > 1 extrapolates past it (and w < 0
away from it). The blend is taken on the transformer's output, before the adapter turns
it into a velocity and applies CFG; both steps are affine in the output with
coefficients that do not depend on the model, so this is the same blend of the final
velocities. w = 0 and w = 1 run only the base or only the aligned forward, so they are
the base and aligned models exactly (tested bit for bit) at the cost of one forward.

For a LoRA policy both predictions come from one model (adapters enabled and disabled);
for full checkpoints ``base`` is a second module.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def _blend(base, aligned, w: float):
    if isinstance(aligned, torch.Tensor):
        return (1.0 - w) * base + w * aligned
    if isinstance(aligned, tuple):
        return (_blend(base[0], aligned[0], w), *aligned[1:])
    if hasattr(aligned, "sample"):  # diffusers Transformer2DModelOutput
        aligned.sample = _blend(base.sample, aligned.sample, w)
        return aligned
    raise TypeError(f"cannot blend transformer outputs of type {type(aligned).__name__}")


class GuidedTransformer(nn.Module):
    """A transformer-shaped module whose output is the RLG blend at ``scale``."""

    def __init__(self, aligned: nn.Module, scale: float, base: nn.Module | None = None):
        super().__init__()
        self.aligned, self.base_module, self.scale = aligned, base, float(scale)
        if base is None and not hasattr(aligned, "disable_adapters"):
            raise ValueError(
                "RLG without a base module needs a LoRA (peft) transformer to disable its adapters; "
                "pass base= for full checkpoints"
            )

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:  # config, dtype, device, ...: the aligned model's
            return getattr(super().__getattr__("aligned"), name)

    @contextlib.contextmanager
    def _base(self):
        if self.base_module is not None:
            yield self.base_module
            return
        self.aligned.disable_adapters()
        try:
            yield self.aligned
        finally:
            self.aligned.enable_adapters()

    def forward(self, *args, **kwargs):
        if self.scale == 1.0:
            return self.aligned(*args, **kwargs)
        with self._base() as base:
            base_out = base(*args, **kwargs)
        if self.scale == 0.0:
            return base_out
        return _blend(base_out, self.aligned(*args, **kwargs), self.scale)
