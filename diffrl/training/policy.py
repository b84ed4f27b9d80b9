"""The trainable policy: LoRA (peft) or full fine-tuning of the adapter's transformer,
its frozen reference for the KL, and an optional EMA of the trainable weights."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from diffrl.runtime.sharding import gathered_to_cpu, is_sharded, like, reshard, whole
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


class EMA:
    """Exponential moving average of parameters (used for evaluation when enabled).

    :meth:`update` is called after every applied optimizer step; n counts those steps.
    The average moves after step n when (n + 1) % ``every`` == 0, with decay d(n) =
    min(decay, (1 + n) / (10 + n)) under ``warmup`` (early averages are not dominated by
    the initial weights), else ``decay``; each such update is applied ``repeats`` times.
    This is flow_grpo's and DiffusionNFT's ``EMAModuleWrapper`` (``flow_grpo/ema.py``:
    ``get_current_decay``, ``step``); flow_grpo builds it with decay 0.9 and
    ``update_step_interval`` 8 (``scripts/train_sd3.py``) and calls ``step`` once per
    micro-batch of samples rather than once per optimizer step, so at its 2 micro-batches
    per optimizer step every update lands twice (``repeats`` 2). With the defaults
    (every 1, repeats 1) it is the plain per-step average; toy pretraining uses warm-up.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        decay: float,
        warmup: bool = False,
        every: int = 1,
        repeats: int = 1,
    ):
        if every < 1 or repeats < 1:
            raise ValueError(f"EMA every ({every}) and repeats ({repeats}) must be at least 1")
        self.params = list(params)
        self.decay, self.warmup, self.every, self.repeats = decay, warmup, every, repeats
        self.steps = 0  # optimizer steps seen
        self.updates = 0  # steps at which the average moved
        self.shadow = [p.detach().clone().float() for p in self.params]  # shards under FSDP

    def decay_at(self, step: int) -> float:
        """The decay used after optimizer step ``step`` (1-based)."""
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: count it, and move the average if the schedule says so."""
        self.steps += 1
        if (self.steps + 1) % self.every:
            return
        self.updates += 1
        weight = 1.0 - self.decay_at(self.steps)
        for _ in range(self.repeats):
            for s, p in zip(self.shadow, self.params):
                s.lerp_(p.detach().float(), weight)

    @contextlib.contextmanager
    def swapped_in(self):
        """Temporarily load the EMA weights into the live parameters."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, p in zip(backup, self.params):
                    p.copy_(b)

    def named_state_dict(self, policy) -> dict[str, torch.Tensor]:
        """The averaged weights by the trainable parameters' names (whole, on the CPU;
        collective under FSDP: every process calls it)."""
        names = [n for n, _ in policy.trainable_named_parameters()]
        if len(names) != len(self.shadow):
            raise ValueError(f"EMA of {len(self.shadow)} tensors, but the policy trains {len(names)}")
        return {n: whole(s).cpu() for n, s in zip(names, self.shadow)}

    def state_dict(self) -> dict:
        """Whole shadows, also under FSDP (collective there; accelerate calls it on every
        process and the main one writes)."""
        return {
            "decay": self.decay,
            "steps": self.steps,
            "updates": self.updates,
            "shadow": [whole(s).cpu() for s in self.shadow],
        }

    def load_state_dict(self, state: dict) -> None:
        self.shadow = [like(s.float(), p.detach().float()) for s, p in zip(state["shadow"], self.params)]
        self.updates = state.get("updates", 0)
        self.steps = state.get("steps", self.updates)  # before the schedule, one update per step


class OldPolicy(EMA):
    """DiffusionNFT's old policy: an EMA of the trainable weights whose decay ramps with
    the number s of optimizer steps completed: 0 while s < ``flat``, then
    min(rate * (s - flat), max) (NVlabs/DiffusionNFT, ``scripts/train_nft_sd3.py:
    return_decay``, evaluated at its ``global_step`` after each epoch's update).
    :meth:`refresh` is called once per iteration, after the update, so within an
    iteration the old policy is fixed; decay 0 makes it the policy that will sample the
    next iteration."""

    def __init__(self, params: list[torch.nn.Parameter], flat: int, rate: float, maximum: float):
        super().__init__(params, decay=0.0)
        self.flat, self.rate, self.maximum = flat, rate, maximum

    def decay_at(self, optimizer_steps: int) -> float:
        return (
            0.0
            if optimizer_steps < self.flat
            else min(self.rate * (optimizer_steps - self.flat), self.maximum)
        )

    @torch.no_grad()
    def refresh(self, optimizer_steps: int) -> None:
        decay = self.decay_at(optimizer_steps)
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), 1.0 - decay)
        self.updates += 1
