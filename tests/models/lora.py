"""LoRA plumbing shared by the adapter tests: a random LoRA on the adapter's default
targets (alpha != rank on purpose: diffusers reloads with alpha == rank unless the
LoraConfig is saved as metadata), and its state dict in diffusers' naming."""

from __future__ import annotations

import torch


def add_random_lora(adapter, targets=None, rank: int = 4, alpha: float = 8.0, seed: int = 7) -> None:
    """Add a LoRA to ``adapter.transformer`` and give its B matrices N(0, 0.1^2) values,
    so that the LoRA changes the velocity (peft starts B at zero)."""
    from peft import LoraConfig

    targets = list(adapter.default_lora_targets if targets is None else targets)
    adapter.transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights="gaussian")
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def lora_state(adapter) -> dict[str, torch.Tensor]:
    """The trained LoRA as the trainer exports it (peft state, diffusers key names)."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    return convert_state_dict_to_diffusers(get_peft_model_state_dict(adapter.transformer))
