"""FLUX.1 adapter over diffusers' ``FluxPipeline``.

FLUX works on packed latents: the VAE latent (C, h, w) is cut into 2x2 patches and
flattened to (h/2 * w/2 tokens, 4C). FLUX.1-dev is guidance-distilled: instead of CFG,
the guidance scale enters the transformer as an embedding (``guidance_embeds``), so a
single forward per step is enough and ``guidance=False`` changes nothing.
The schedule is FlowMatchEuler with resolution-dependent ("dynamic") shift
``mu = m * image_seq_len + b`` (FLUX paper, sec. 3.2; ``calculate_shift`` in diffusers).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from diffrl.models import tiny
from diffrl.models.base import Conditioning
from diffrl.models.loading import PackedLatentAdapter, finalize_pipeline, module_dtype, unwrap
from diffrl.models.sd3 import DOUBLE_BLOCK_MODULATION

# Real FLUX.1 VAE latent normalisation (diffusers AutoencoderKL config of FLUX.1-dev).
_FLUX_VAE_SCALING = 0.3611
_FLUX_VAE_SHIFT = 0.1159


# The layers the low-precision exploration copy and the FP8 flow keep in high precision
# (anchored regexes; why these: diffrl/precision/keep_high.py).
KEEP_HIGH = (
    r"x_embedder",
    r"context_embedder",
    r"time_text_embed\..+",  # timestep, guidance and pooled-text embedders
    DOUBLE_BLOCK_MODULATION,
    r"single_transformer_blocks\.\d+\.norm\.linear",  # AdaLayerNormZeroSingle
    r"norm_out\.linear",
    r"proj_out",  # top level only: single_transformer_blocks.N.proj_out is quantized
)


class FluxAdapter(PackedLatentAdapter):
    """FLUX.1 [dev|schnell]: CLIP pooled + T5 sequence embeddings, packed latents, guidance embedding."""

    family = "flux"
    pipeline_class = FluxPipeline
    # 16-channel VAE latents at 1/8 (packed 2x2 into 64 channels at 1/16: the same count)
    cfg_as_batch = False  # guidance is an embedding of the distilled transformer
    keep_high = KEEP_HIGH
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    # flow_grpo / diffusers train_dreambooth_lora_flux.py: attention (image and context
    # streams) and both feed-forwards of the double-stream blocks; "attn.to_q/k/v" also
    # match the single-stream blocks.
    default_lora_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, model_cfg) -> FluxAdapter:
        """Same classes as FLUX.1-dev at toy size: 1 double + 1 single block, hidden 32."""
        clip_tok, t5_tok = tiny.clip_tokenizer(), tiny.t5_tokenizer()
        with tiny.seeded(model_cfg.tiny_seed):
            from transformers import CLIPTextModel, T5EncoderModel

            text_encoder = CLIPTextModel(tiny.clip_text_config(clip_tok, hidden=32))
            text_encoder_2 = T5EncoderModel(tiny.t5_config(t5_tok, d_model=32))
            vae = tiny.tiny_autoencoder_kl(4, _FLUX_VAE_SCALING, _FLUX_VAE_SHIFT)
            transformer = FluxTransformer2DModel(
                patch_size=1,
                in_channels=16,  # 4 latent channels x 2x2 packing
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=32,  # T5 d_model
                pooled_projection_dim=32,  # CLIP hidden size
                guidance_embeds=True,
                axes_dims_rope=(4, 6, 6),
            )
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        pipe = cls.pipeline_class(  # FluxPipeline, or FluxKontextPipeline (same components)
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=clip_tok,
            text_encoder_2=text_encoder_2,
            tokenizer_2=t5_tok,
            transformer=transformer,
        )
        return cls(finalize_pipeline(pipe, model_cfg), model_cfg)

    # -- prompts ------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        """Pooled CLIP + T5 sequence; no negatives: FLUX.1 guidance is an embedding, not CFG."""
        prompt_embeds, pooled, _text_ids = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, max_sequence_length=self.cfg.max_sequence_length
        )
        return self._encoded(self.cond_keys, (prompt_embeds, pooled))

    # -- latents and schedule -----------------------------------------------------------
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly FluxPipeline's schedule: sigmas=linspace(1, 1/N, N) and mu from the image
        sequence length, through a fresh FlowMatchEuler scheduler built from the pipeline's."""
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        config = scheduler.config
        grid = np.linspace(1.0, 1 / num_steps, num_steps)
        mu = calculate_shift(
            self.latent_shape()[0],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=grid, mu=mu)
        return scheduler.sigmas.to(torch.float32).cpu()

    # -- model --------------------------------------------------------------------------
    def _timestep(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What the transformer reads as the timestep (it multiplies by 1000 itself):
        FluxPipeline casts t = 1000 sigma to the latents' dtype and passes t / 1000;
        DanceGRPO and BranchGRPO pass int(1000 sigma) / 1000 (``model.truncate_timestep``;
        DanceGRPO fastvideo/train_grpo_flux.py:231-232 and 506-509, BranchGRPO
        fastvideo/train_branchgrpo_flux.py:428-443 and 1510)."""
        scale = self.pipe.scheduler.config.num_train_timesteps
        if self.cfg.truncate_timestep:
            # float32 product, truncated toward zero, as int(sigma * 1000) on their float32 grid
            return (sigma.float() * scale).long().float() / scale
        return (sigma.float() * scale).to(dtype) / scale

    def _forward(self, transformer, latents, sigma, emb):
        config = unwrap(transformer).config
        dtype = module_dtype(transformer)
        batch = latents.shape[0]
        h, w = self._latent_hw()
        img_ids = FluxPipeline._prepare_latent_image_ids(batch, h // 2, w // 2, latents.device, dtype)
        prompt_embeds = emb["prompt_embeds"].to(dtype)
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=latents.device, dtype=dtype)
        guidance = None
        if config.guidance_embeds:
            # fp32 like FluxPipeline; the transformer casts and scales it by 1000 itself
            guidance = torch.full((batch,), float(self.cfg.guidance_scale), device=latents.device)
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=self._timestep(sigma, dtype),
            guidance=guidance,
            pooled_projections=emb["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Unpack, undo the VAE normalisation (``x / scaling + shift``), decode, map to [0, 1]."""
        vae = self.pipe.vae
        latents = FluxPipeline._unpack_latents(
            latents, self.cfg.height, self.cfg.width, self.pipe.vae_scale_factor
        )
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0]
        return tiny.to_unit_range(images)
