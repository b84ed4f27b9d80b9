"""The trainable policy: LoRA (peft) or full fine-tuning of the adapter's transformer and
its frozen reference (the KL's, the base of comparisons). Training updates it; an
inference session builds the same one, so a checkpoint's trainable weights load into it."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from diffrl.runtime.sharding import gathered_to_cpu, is_sharded, like, reshard
from diffrl.sampling import rng

# LoRA's initialisation: A ~ N(0, 1/r), B = 0 (peft's "gaussian"), as flow_grpo's
# train_sd3.py and the other references start their LoRA
LORA_INIT = "gaussian"


class Policy:
    """Owns what is trained. LoRA: the reference is the same transformer with adapters
    disabled (no second copy). Full fine-tuning: the reference is a frozen deep copy.

    Trainable weights are fp32 master weights whatever ``model.dtype`` is (forwards run
    under autocast): an AdamW step of lr 1e-5 on a bf16 weight is below bf16's resolution
    (8 bits of mantissa, a relative step of 2^-8) and is rounded away, so a bf16 full
    fine-tune would train nothing and say nothing. ``upcast_trainable=False`` leaves the
    upcast to accelerate's FSDP2 ``prepare``, which does it shard by shard (upcasting here,
    before sharding, would hold a whole fp32 copy on every process)."""

    def __init__(self, adapter, model_cfg, seed: int = 0, upcast_trainable: bool = True):
        self.adapter = adapter
        self.cfg = model_cfg
        self.is_lora = not model_cfg.full_finetune
        transformer = adapter.transformer
        self.frozen_reference = None
        if self.is_lora:
            from peft import LoraConfig

            targets = model_cfg.lora.target_modules or list(adapter.default_lora_targets)
            # LoRA A is randomly initialised: seed it, so two runs of one config start identically
            devices = [transformer.device] if transformer.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(rng.derive_seed(seed, "lora_init"))
                transformer.add_adapter(
                    LoraConfig(
                        r=model_cfg.lora.rank,
                        lora_alpha=model_cfg.lora.alpha,
                        lora_dropout=model_cfg.lora.dropout,
                        init_lora_weights=LORA_INIT,
                        target_modules=targets,
                    )
                )
        else:
            # copied before the upcast: the reference only runs forwards, in model.dtype
            self.frozen_reference = copy.deepcopy(transformer).requires_grad_(False).eval()
            transformer.requires_grad_(True)
        if self.is_lora and model_cfg.init_lora:
            from diffrl.models.lora_files import load_init_lora

            load_init_lora(transformer, model_cfg.init_lora, model_cfg.lora)
        if upcast_trainable or self.is_lora:  # LoRA weights are small: fp32 before sharding is fine
            upcast_trainable_to_fp32(transformer)
        if model_cfg.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        transformer.eval()  # no dropout: replays must be exact

    @property
    def transformer(self) -> torch.nn.Module:
        return self.adapter.transformer

    def trainable_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        reshard(self.transformer)  # under FSDP: the shards, not a unit left gathered by a forward
        return [(n, p) for n, p in self.transformer.named_parameters() if p.requires_grad]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.trainable_named_parameters()]

    @contextlib.contextmanager
    def reference(self):
        """Yield the reference transformer (LoRA disabled, or the frozen copy)."""
        if self.frozen_reference is not None:
            yield self.frozen_reference
            return
        self.transformer.disable_adapters()
        try:
            yield self.transformer
        finally:
            self.transformer.enable_adapters()

    # -- state ------------------------------------------------------------------------
    def trainable_state_dict(self, keep: bool | None = None) -> dict[str, torch.Tensor]:
        """Whole tensors on the CPU, gathered one at a time under FSDP (collective there:
        every process calls it; only the main one, which writes, keeps them unless
        ``keep`` says otherwise). See :func:`~diffrl.runtime.sharding.gathered_to_cpu`."""
        return gathered_to_cpu(self.trainable_named_parameters(), keep)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.trainable_named_parameters())
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint weights do not match the policy (LoRA rank/targets or full_finetune "
                f"differ?): missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(like(state[n], p))

    def save_pretrained(self, directory: Path, trainable: dict[str, torch.Tensor] | None = None) -> None:
        """diffusers-format weights: ``pipe.load_lora_weights(directory)`` for LoRA, or a
        ``transformer/`` folder loadable with ``from_pretrained`` for full fine-tuning.
        ``trainable``: the whole trainable weights, already gathered (under FSDP the live
        ones are shards)."""
        directory = Path(directory)
        if self.is_lora:
            from peft.utils import get_peft_model_state_dict

            weights = get_peft_model_state_dict(self.transformer, state_dict=trainable)
            self.adapter.save_lora(directory, weights)
        elif trainable is not None and any(is_sharded(p) for p in self.transformer.parameters()):
            # diffusers' save_pretrained reads the live (sharded) weights; write the gathered
            # ones in its layout instead: config.json + diffusion_pytorch_model.safetensors
            from safetensors.torch import save_file

            self.transformer.save_config(directory / "transformer")
            weights = {k: v.contiguous().cpu() for k, v in trainable.items()}
            save_file(weights, str(directory / "transformer" / "diffusion_pytorch_model.safetensors"))
        else:
            self.transformer.save_pretrained(directory / "transformer")


def upcast_trainable_to_fp32(module: torch.nn.Module) -> None:
    """Make every trainable parameter of ``module`` fp32 in place."""
    for p in module.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
