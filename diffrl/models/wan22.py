"""Wan 2.2 A14B text-to-video adapter: two experts over diffusers' ``WanPipeline``.

Wan2.2 A14B (Wan team, "Wan 2.2" release, 2025) splits denoising between two 14B
transformers of the Wan 2.1 architecture: ``transformer`` (the high-noise expert, for
layout) runs while the timestep t >= ``boundary_ratio * 1000`` and ``transformer_2``
(the low-noise expert, for detail) below it; each has its own CFG scale
(``guidance_scale`` and ``guidance_scale_2``: 4.0 and 3.0 in the published T2V
settings). diffusers' ``WanPipeline`` implements this with ``boundary_ratio`` in its
config (``pipeline_wan.py``: ``if t >= boundary_timestep: current_model =
self.transformer``).

RL trains both experts. :class:`TwoExperts` holds them as one module (``high``,
``low``) that routes each sample by its own timestep, so LoRA, the optimizer, the
reference, the exploration copy and checkpoints see one policy. Everything else
(text encoder, VAE, flow-sigma grid, continuous timestep) is Wan 2.1's
(:mod:`diffrl.models.wan`). The expert choice compares the integer timestep
``floor(1000 sigma)`` with the boundary, as the pipeline compares its integer UniPC
timesteps.

Full fine-tuning is refused (config check): two 14B experts plus a frozen reference
do not fit the GPUs it would run on, and the peers train Wan2.2 with LoRA.
"""

from __future__ import annotations

import torch
from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

from diffrl.models import tiny
from diffrl.models.loading import finalize_pipeline, module_dtype
from diffrl.models.wan import KEEP_HIGH as WAN_KEEP_HIGH
from diffrl.models.wan import WanAdapter

# The layers the low-precision exploration copy and the FP8 flow keep in high precision
# (anchored regexes; why these: diffrl/precision/keep_high.py).
# Wan2.2 A14B: the same layers in each of its two experts (``high.`` and ``low.``, the
# submodules of ``diffrl.models.wan22.TwoExperts``)
KEEP_HIGH = tuple(rf"(high|low)\.{pattern}" for pattern in WAN_KEEP_HIGH)


class TwoExperts(torch.nn.Module):
    """The high- and low-noise experts as one module, routed per sample by timestep.

    ``forward`` takes the transformer's arguments with a timestep per sample; samples
    with ``floor(t) >= boundary_timestep`` go to ``high``, the rest to ``low``. When a
    batch uses only one expert, the other's trainable weights enter the output times
    zero, so every trainable weight gets a (zero) gradient in every backward: DDP and
    FSDP need all of them in each reduction, and one process and many then step the
    optimizer identically.
    """

    _no_split_modules = WanTransformer3DModel._no_split_modules
    _supports_gradient_checkpointing = True

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary_timestep: float):
        super().__init__()
        self.high, self.low = high, low
        self.boundary_timestep = float(boundary_timestep)

    # -- what the trainer reads from a diffusers model ---------------------------------
    @property
    def config(self):
        return self.high.config

    @property
    def dtype(self) -> torch.dtype:
        return self.high.dtype

    @property
    def device(self) -> torch.device:
        return self.high.device

    @property
    def experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(high, low): models of the same architecture, one of which runs each sample."""
        return (self.high, self.low)

    @property
    def peft_config(self):
        return getattr(self.high, "peft_config", None)

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        import copy

        self.high.add_adapter(adapter_config, adapter_name)
        self.low.add_adapter(copy.deepcopy(adapter_config), adapter_name)

    def disable_adapters(self) -> None:
        self.high.disable_adapters()
        self.low.disable_adapters()

    def enable_adapters(self) -> None:
        self.high.enable_adapters()
        self.low.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        self.high.enable_gradient_checkpointing()
        self.low.enable_gradient_checkpointing()

    def disable_gradient_checkpointing(self) -> None:
        self.high.disable_gradient_checkpointing()
        self.low.disable_gradient_checkpointing()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.high.is_gradient_checkpointing

    def set_attention_backend(self, backend: str) -> None:
        self.high.set_attention_backend(backend)
        self.low.set_attention_backend(backend)

    # -- routing ------------------------------------------------------------------------
    def uses_high(self, timestep: torch.Tensor) -> torch.Tensor:
        """(B,) bool: which samples the high-noise expert denoises."""
        return torch.floor(timestep.double()) >= self.boundary_timestep

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs):
        if timestep.is_meta:  # FLOP and memory counts: no values to route by; the experts cost the same
            return (
                self.high(hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs)[0],
            )
        # the one host read of a forward: which expert takes which rows (Wan2.2 routes on
        # the timestep's value, so the host must know it to launch the right expert)
        high = self.uses_high(timestep).tolist()
        routes = (
            (self.high, [i for i, h in enumerate(high) if h]),
            (self.low, [i for i, h in enumerate(high) if not h]),
        )
        out = None
        for expert, rows in routes:
            if not rows:
                continue
            whole = len(rows) == len(high)  # one expert for the batch: no gather or scatter
            ix = None if whole else torch.tensor(rows, device=hidden_states.device)
            part = expert(
                hidden_states=hidden_states if whole else hidden_states[ix],
                timestep=timestep if whole else timestep[ix],
                encoder_hidden_states=encoder_hidden_states if whole else encoder_hidden_states[ix],
                return_dict=False,
                **kwargs,
            )[0]
            if whole:
                out = part
                continue
            if out is None:
                out = part.new_empty(hidden_states.shape[:1] + part.shape[1:])
            out = out.index_put((ix,), part)
        idle = next((expert for expert, rows in routes if not rows), None)
        if idle is not None and torch.is_grad_enabled():
            out = out + 0.0 * sum(_local(p).sum() for p in idle.parameters() if p.requires_grad)
        return (out,)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter: its shard under FSDP2 (a DTensor, whose idle
    units were never gathered), so the zero link needs no collective; else the parameter."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


class Wan22Adapter(WanAdapter):
    """Wan 2.2 A14B T2V: Wan 2.1's conditioning and latents, two experts, two CFG scales."""

    family = "wan22"
    weight_components = ("transformer", "transformer_2")  # the two experts
    keep_high = KEEP_HIGH
    # the Wan 2.1 targets, inside either expert (peft matches name suffixes)
    default_lora_targets = WanAdapter.default_lora_targets

    def __init__(self, pipe, model_cfg):
        super().__init__(pipe, model_cfg)
        if pipe.transformer_2 is None or pipe.config.boundary_ratio is None:
            from diffrl.models.base import ModelLoadError

            raise ModelLoadError(
                f"model '{model_cfg.pretrained}' is a one-transformer Wan pipeline (no transformer_2 "
                "or boundary_ratio); use model.family: wan for it, wan22 is for Wan2.2 A14B"
            )
        boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        self._experts = TwoExperts(pipe.transformer, pipe.transformer_2, boundary)

    @property
    def transformer(self) -> torch.nn.Module:
        return self._experts

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.pipe.vae, self.pipe.text_encoder]

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, model_cfg) -> Wan22Adapter:
        """Wan 2.1's tiny twin with a second expert (seeded apart) and the published T2V
        A14B boundary 0.875 and shift 12 (Wan2.2 ``wan/configs/wan_t2v_A14B.py``)."""
        twin = WanAdapter.build_tiny(model_cfg).pipe
        with tiny.seeded(model_cfg.tiny_seed + 1):
            transformer_2 = WanTransformer3DModel.from_config(twin.transformer.config)
        scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=12.0
        )
        pipe = WanPipeline(
            tokenizer=twin.tokenizer,
            text_encoder=twin.text_encoder,
            vae=twin.vae,
            scheduler=scheduler,
            transformer=twin.transformer,
            transformer_2=transformer_2,
            boundary_ratio=0.875,
        )
        return cls(finalize_pipeline(pipe, model_cfg), model_cfg)

    # -- model --------------------------------------------------------------------------
    def _forward(self, transformer, latents, sigma, emb):
        dtype = module_dtype(transformer)
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=sigma.float() * self.pipe.scheduler.config.num_train_timesteps,
            encoder_hidden_states=emb["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def guidance_scales(self, sigma: torch.Tensor) -> torch.Tensor:
        """(B,) CFG scale per sample: ``guidance_scale`` on the high-noise expert's steps,
        ``guidance_scale_2`` (default: the same) on the low-noise one's."""
        low_scale = self.cfg.guidance_scale_2
        low_scale = self.cfg.guidance_scale if low_scale is None else low_scale
        high = self._experts.uses_high(sigma.float() * self.pipe.scheduler.config.num_train_timesteps)
        return torch.where(high, float(self.cfg.guidance_scale), float(low_scale)).to(sigma.device)

    def _combine_cfg(self, v_uncond, v_cond, sigma) -> torch.Tensor:
        """CFG with each sample's own expert's scale (:meth:`guidance_scales`)."""
        scale = self.guidance_scales(sigma).view(-1, *[1] * (v_cond.ndim - 1))
        return v_uncond + scale * (v_cond - v_uncond)

    # -- LoRA I/O ----------------------------------------------------------------------
    def save_lora(self, directory, transformer_lora_state: dict) -> None:
        """Two LoRA files that ``pipe.load_lora_weights`` reads: the high-noise expert's in
        ``directory`` (loads into ``transformer``) and the low-noise expert's in
        ``directory/transformer_2`` (``load_lora_weights(dir / "transformer_2",
        load_into_transformer_2=True)``)."""
        from pathlib import Path

        from diffrl.models.base import FlowAdapter

        directory = Path(directory)
        for prefix, target in (("high.", directory), ("low.", directory / "transformer_2")):
            part = {k[len(prefix) :]: v for k, v in transformer_lora_state.items() if k.startswith(prefix)}
            FlowAdapter.save_lora(_ExpertView(self, prefix[:-1]), target, part)


class _ExpertView:
    """``FlowAdapter.save_lora`` for one expert: that expert's peft config and the pipeline."""

    def __init__(self, adapter: Wan22Adapter, name: str):
        self.pipe = adapter.pipe
        self.transformer = getattr(adapter.transformer, name)
