"""The memory estimate's FP8 training part (diffrl/perf/estimate.py, fp8_training_bytes):
the weights the unified flow's backward keeps, counted here from the module tree."""

import re

import pytest
import torch

from diffrl.models import build_adapter
from diffrl.models.policy import Policy
from diffrl.perf.estimate import fp8_training_bytes
from tests.helpers import quick_config


def _quantized_weights(transformer, keep_high) -> dict[str, int]:
    """Weights of the linear layers outside the keep-high list, by their (LoRA-free) name:
    peft's wrapped layers appear as NAME.base_layer, their factors as NAME.lora_*."""
    out = {}
    for name, module in transformer.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".lora_" in name:
            continue
        name = name.removesuffix(".base_layer")
        if not any(re.fullmatch(p, name) for p in keep_high):
            out[name] = module.weight.numel()
    return out


@pytest.mark.parametrize(
    "backend,lora,per_weight", [("auto", True, 2), ("reference", True, 1), ("auto", False, 0)]
)
def test_kept_weights_by_backend(tmp_path, backend, lora, per_weight):
    sets = ["precision.rollout=fp8", "precision.train=fp8", f"precision.backend={backend}"]
    sets += [] if lora else ["model.full_finetune=true"]
    cfg = quick_config("tiny_flux_flowgrpo", tmp_path, *sets)
    adapter = build_adapter(cfg.model)
    Policy(adapter, cfg.model)
    weights = _quantized_weights(adapter.transformer, adapter.keep_high)
    assert len(weights) > 10
    assert fp8_training_bytes(cfg, adapter.transformer, lora) == per_weight * sum(weights.values())


def test_gradient_checkpointing_keeps_one_block(tmp_path):
    cfg = quick_config(
        "tiny_flux_flowgrpo",
        tmp_path,
        "precision.rollout=fp8",
        "precision.train=fp8",
        "model.gradient_checkpointing=true",
    )
    adapter = build_adapter(cfg.model)
    Policy(adapter, cfg.model)
    weights = _quantized_weights(adapter.transformer, adapter.keep_high)
    blocks: dict[str, int] = {}
    for name, n in weights.items():
        m = re.match(r"(\w*blocks\.\d+)\.", name)
        blocks[m.group(1) if m else ""] = blocks.get(m.group(1) if m else "", 0) + n
    outside = blocks.pop("", 0)
    assert fp8_training_bytes(cfg, adapter.transformer, True) == 2 * (outside + max(blocks.values()))
    assert fp8_training_bytes(quick_config("tiny_flux_flowgrpo", tmp_path), adapter.transformer, True) == 0
