"""The model-adapter contract every family (flux, sd3, sana, wan, toy) implements.

An adapter wraps a diffusers pipeline and exposes just what RL needs: prompt
conditioning (cached), the latent shape, the sigma schedule, the velocity with CFG
or guidance, and decoding. The SDE step itself lives in ``diffrl.sampling`` and is
computed in fp32 outside the model, so no diffusers internals are patched.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from rewards.errors import UserError


@dataclass
class Conditioning:
    """Batch-first prompt embeddings (and negative embeddings when CFG is used).

    ``tensors`` maps names (e.g. ``prompt_embeds``, ``pooled_prompt_embeds``,
    ``negative_prompt_embeds``) to tensors whose first dim is the batch.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def select(self, index: torch.Tensor | list[int]) -> Conditioning:
        idx = torch.as_tensor(index, dtype=torch.long)
        return Conditioning({k: v[idx.to(v.device)] for k, v in self.tensors.items()})

    def to(self, device=None, dtype=None) -> Conditioning:
        out = {}
        for k, v in self.tensors.items():
            out[k] = v.to(
                device=device, dtype=dtype if (dtype is not None and v.is_floating_point()) else None
            )
        return Conditioning(out)

    @staticmethod
    def cat(items: list[Conditioning]) -> Conditioning:
        keys = items[0].tensors.keys()
        return Conditioning({k: torch.cat([c.tensors[k] for c in items]) for k in keys})

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        for attr in ("module", "_orig_mod"):
            inner = getattr(module, attr, None)
            if isinstance(inner, torch.nn.Module):
                module = inner
                break
        else:
            return module


class ModelLoadError(UserError, RuntimeError):
    """Weights could not be found or loaded; the message names the model and the fix."""


class FlowAdapter(ABC):
    """One model family over a diffusers pipeline.

    Subclasses set ``family``, ``pipeline_class``, ``default_lora_targets`` and the family
    facts below, and implement the abstract methods. Construct them through
    ``diffrl.models.build_adapter(cfg.model)``.

    The family facts are class attributes so that the run plan, the tiny twin and the
    exploration copy read them without building a model (``diffrl.models.adapter_class``).
    """

    family: str = ""
    default_lora_targets: tuple[str, ...] = ()
    # -- family facts
    latent_channels: int = 16  # channels of the unpacked latent
    spatial_downsample: int = 8  # pixels per latent element along height and width
    temporal_downsample: int | None = None  # video: frames per latent frame (the first kept alone)
    cfg_as_batch: bool = True  # CFG runs a negative batch; FLUX distils guidance into an embedding
    keep_high: tuple[str, ...] = ()  # regexes of layers the low-precision copy keeps in high precision
    edits_images: bool = False  # prompts come with input images (rewards.prompts.EditPrompt)
    masks_text_tokens: bool = False  # padded text tokens are masked: needs a backend that takes masks

    @classmethod
    def is_video_family(cls) -> bool:
        return cls.temporal_downsample is not None

    @classmethod
    def latent_numel(cls, model_cfg) -> int:
        """Latent elements of one sample at ``model_cfg``'s size (the trajectory buffers)."""
        frames = 1
        if cls.temporal_downsample is not None:
            frames = (model_cfg.num_frames - 1) // cls.temporal_downsample + 1
        factor = cls.spatial_downsample
        return cls.latent_channels * frames * (model_cfg.height // factor) * (model_cfg.width // factor)

    # the prompt cache's bound: a real training set (flow_grpo's 25,432 PickScore prompts)
    # through T5-XXL at 512 tokens is 4 MB a prompt, 100 GB if every one stayed on the GPU
    PROMPT_CACHE_BYTES = 2 * 2**30

    def __init__(self, pipe, model_cfg):
        self.pipe = pipe
        self.cfg = model_cfg
        # keyed by (prompt, whether CFG negatives are encoded): an evaluation with its own
        # guidance (eval.guidance_scale) may need the negatives training does not
        self._prompt_cache: OrderedDict[tuple[str, bool], Conditioning] = OrderedDict()
        self._cache_bytes = 0

    # -- components -------------------------------------------------------------------
    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Every module that is never trained (VAE, text encoders)."""
        names = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
        return [m for n in names if (m := getattr(self.pipe, n, None)) is not None]

    def to(self, device) -> FlowAdapter:
        self.pipe.to(device)
        self._prompt_cache = OrderedDict((k, v.to(device)) for k, v in self._prompt_cache.items())
        return self

    def frozen_to(self, device) -> FlowAdapter:
        """Move everything but the trained transformer(s): what FSDP needs, whose
        ``prepare`` places the transformer's shards itself (moving it whole first would
        hold the whole model on every GPU before sharding)."""
        for module in self.frozen_modules():
            module.to(device)
        self._prompt_cache = OrderedDict((k, v.to(device)) for k, v in self._prompt_cache.items())
        return self

    # -- prompts ------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], one_by_one: bool = False) -> Conditioning:
        """Embeddings for ``prompts``, batch-first; each distinct prompt is encoded once and
        kept in a cache of at most :attr:`PROMPT_CACHE_BYTES` (least recently used leave
        first). ``one_by_one`` encodes each missing prompt alone, so its embedding does not
        depend on which prompts shared its batch (an evaluation over several processes)."""
        found = {}
        negatives = bool(getattr(self, "do_cfg", False))
        for p in dict.fromkeys(prompts):
            if (p, negatives) in self._prompt_cache:
                self._prompt_cache.move_to_end((p, negatives))
                found[p] = self._prompt_cache[(p, negatives)]
        missing = [p for p in dict.fromkeys(prompts) if p not in found]
        groups = [[p] for p in missing] if one_by_one else ([missing] if missing else [])
        for group in groups:
            with torch.no_grad():
                fresh = self._encode_uncached(group)
            found.update({p: fresh.select([i]) for i, p in enumerate(group)})
        for p in missing:
            self._remember((p, negatives), found[p])
        return Conditioning.cat([found[p] for p in prompts])

    @contextlib.contextmanager
    def guidance_scale_as(self, scale: float | None):
        """Sample with another guidance value inside the block (the CFG scale, or FLUX's
        guidance embedding): evaluation's own ``eval.guidance_scale``, as flow_grpo's
        ``sample.eval_guidance_scale``. None or the same value changes nothing. Prompts
        encoded inside get the CFG negatives the scale needs."""
        if scale is None or float(scale) == float(self.cfg.guidance_scale):
            yield
            return
        kept = self.cfg.guidance_scale
        self.cfg.guidance_scale = float(scale)
        try:
            yield
        finally:
            self.cfg.guidance_scale = kept

    def _remember(self, prompt: tuple[str, bool], cond: Conditioning) -> None:
        self._prompt_cache[prompt] = cond
        self._cache_bytes += _nbytes(cond)
        while self._cache_bytes > self.PROMPT_CACHE_BYTES and len(self._prompt_cache) > 1:
            _, old = self._prompt_cache.popitem(last=False)
            self._cache_bytes -= _nbytes(old)

    @abstractmethod
    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        """Encode prompts with the pipeline's text encoders (and negatives if CFG is on)."""

    # -- latents and schedule ----------------------------------------------------------
    @abstractmethod
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape in the transformer's layout (e.g. packed for FLUX)."""

    @abstractmethod
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """fp32 tensor of ``num_steps + 1`` sigmas from 1 (noise) down to 0, consistent with
        the pipeline's scheduler config (shift, dynamic shift)."""

    # -- model -------------------------------------------------------------------------
    @abstractmethod
    def velocity(
        self,
        transformer,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        guidance: bool = True,
        detach_uncond: bool = False,
    ) -> torch.Tensor:
        """Predicted velocity v = dx/dsigma-direction (flow matching: x_t = (1-s) x0 + s x1,
        v = x1 - x0), in fp32 and the shape of ``latents``.

        ``transformer`` is passed explicitly so the caller can use a DDP-wrapped policy,
        a frozen reference copy or an exploration copy. ``sigma`` has shape (B,).
        ``guidance=False`` skips CFG (cond branch only) for families that use CFG;
        ``detach_uncond`` keeps the gradient of the conditional branch only.
        """

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1], (B, 3, H, W) fp32; video families return (B, F, 3, H, W)."""

    # -- LoRA I/O ----------------------------------------------------------------------
    def save_lora(self, directory, transformer_lora_state: dict) -> None:
        """Diffusers LoRA file (PEFT key names) with the adapter's LoraConfig as metadata.

        Two diffusers quirks are handled here so ``pipe.load_lora_weights(directory)``
        reproduces the trained model exactly:

        * ``convert_state_dict_to_diffusers`` renames only some keys (``to_q.lora_A`` ->
          ``to_q.lora.down``, but not ``add_q_proj.lora_A``), and the loader converts back
          only when the *first* key is old-style; for SD3 (``add_*`` sorts first) the
          ``to_*`` LoRA was silently dropped. Keys are normalised to ``lora_A``/``lora_B``.
        * Without metadata diffusers reloads with lora_alpha == rank, which silently
          rescales a LoRA trained with alpha != rank (the default config has alpha = 2r).
        """
        from diffusers.utils import convert_unet_state_dict_to_peft

        state = transformer_lora_state
        if any(".lora.down" in k or ".lora.up" in k for k in state):
            state = convert_unet_state_dict_to_peft(dict(state))
        peft_config = getattr(unwrap(self.transformer), "peft_config", None) or {}
        metadata = None
        if len(peft_config) == 1:
            metadata = next(iter(peft_config.values())).to_dict()
        type(self.pipe).save_lora_weights(
            directory, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata
        )


def _nbytes(cond: Conditioning) -> int:
    return sum(t.numel() * t.element_size() for t in cond.tensors.values())
