"""The Sol-RL exploration copy: the policy transformer with LoRA merged in, its linear
layers run at a lower precision (reference fake quantization), re-synced from the policy
after every optimizer step.

* ``nvfp4``: weights and input activations in NVFP4 (W4A4); activation tensor scales are
  taken per sample, so a sample's numerics do not depend on its batch.
* ``fp8``: weights E4M3 per output row, activations E4M3 per sample.
* ``bf16``: the control; merged weights, no quantization.

Layers whose qualified name fully matches a ``keep_high`` pattern stay in high
precision. Patterns are anchored regexes on purpose: a loose ``proj_out`` substring
would also keep every FLUX single block's ``proj_out``.

Sync recomputes every quantized weight (and so its amax and scales) from the current
merged weights W + scale * B @ A; nothing is cached between syncs, so scales cannot go
stale.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from diffrl.quant.formats import fake_fp8, fake_nvfp4

PRECISIONS = ("nvfp4", "fp8", "bf16")


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def merged_weight(module: nn.Module) -> torch.Tensor:
    """The effective fp32 weight of a linear layer: base + every active LoRA delta."""
    base = module.base_layer if _is_lora_layer(module) else module
    weight = base.weight.detach().float()
    if _is_lora_layer(module) and not module.disable_adapters:
        for name in module.active_adapters:
            if name in module.lora_A:
                weight = weight + module.get_delta_weight(name).detach().float()
    return weight


def _unwrapped_copy(transformer: nn.Module) -> nn.Module:
    """A deep copy with every peft LoRA layer replaced by its base layer."""
    model = copy.deepcopy(transformer)
    for name, module in list(model.named_modules()):
        if _is_lora_layer(module):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.base_layer)
    return model.requires_grad_(False).eval()


def _activation_quantizer(precision: str):
    if precision == "nvfp4":
        return lambda x: fake_nvfp4(x, per_sample=True).to(x.dtype)
    # one E4M3 scale per sample: flatten each sample into a row
    return lambda x: fake_fp8(x.reshape(x.shape[0], -1), per_row=True).reshape(x.shape).to(x.dtype)


class ExplorationCopy:
    """A low-precision copy of a (possibly LoRA-wrapped) transformer."""

    def __init__(self, transformer: nn.Module, precision: str, keep_high=()):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown exploration precision '{precision}'; valid: {', '.join(PRECISIONS)}")
        self.precision = precision
        self.model = _unwrapped_copy(transformer)
        keep = [re.compile(p) for p in keep_high]
        self.linear_names = [n for n, m in self.model.named_modules() if isinstance(m, nn.Linear)]
        self.quantized = [n for n in self.linear_names if not any(p.fullmatch(n) for p in keep)]
        if precision != "bf16":
            quant = _activation_quantizer(precision)
            for name in self.quantized:
                self.model.get_submodule(name).register_forward_pre_hook(lambda _m, args: (quant(args[0]), *args[1:]))
        self.sync(transformer)

    def quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        if self.precision == "nvfp4":
            return fake_nvfp4(weight)
        if self.precision == "fp8":
            return fake_fp8(weight, per_row=True)
        return weight

    @torch.no_grad()
    def sync(self, transformer: nn.Module) -> None:
        """Copy the current weights in (LoRA merged) and re-quantize them."""
        source = dict(transformer.named_modules())
        quantized = set(self.quantized)
        for name in self.linear_names:
            target = self.model.get_submodule(name)
            weight = merged_weight(source[name])
            if name in quantized:
                weight = self.quantize_weight(weight)
            target.weight.copy_(weight.to(target.weight.dtype))
        # everything else (norms, embeddings, biases) is copied as it is
        own = self.model.state_dict()
        done = {f"{n}.weight" for n in self.linear_names}
        for key, value in transformer.state_dict().items():
            key = key.replace(".base_layer.", ".")
            if "lora_" not in key and key in own and key not in done:
                own[key].copy_(value)
