"""Stable Diffusion 3 / 3.5 adapter over diffusers' ``StableDiffusion3Pipeline``.

SD3 is an MMDiT conditioned on two CLIP encoders (sequence + pooled) and T5, with real
classifier-free guidance against empty-prompt embeddings. The transformer takes the
timestep on the 0..1000 scale (``sigma * 1000``). The schedule is FlowMatchEuler with a
fixed shift (3.0 for SD3.5), set exactly the way the pipeline sets it.
"""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from diffrl.models import tiny
from diffrl.models.base import Conditioning
from diffrl.models.loading import PipelineAdapter, finalize_pipeline, module_dtype

# Real SD3/SD3.5 VAE latent normalisation.
_SD3_VAE_SCALING = 1.5305
_SD3_VAE_SHIFT = 0.0609


# The layers the low-precision exploration copy and the FP8 flow keep in high precision
# (anchored regexes; why these: diffrl/precision/keep_high.py).
# adaLN-Zero modulation of a double-stream block (SD3.5's AdaLayerNormZeroX and the
# last block's AdaLayerNormContinuous context norm also name their linear ``.linear``)
DOUBLE_BLOCK_MODULATION = r"transformer_blocks\.\d+\.norm1(_context)?\.linear"

KEEP_HIGH = (
    r"pos_embed\.proj",  # patch embedding conv (2x2; never quantized, listed for intent)
    r"context_embedder",
    r"time_text_embed\..+",  # timestep and pooled-text embedders
    DOUBLE_BLOCK_MODULATION,
    r"norm_out\.linear",
    r"proj_out",
)  # also the toy model's: it is an SD3Transformer2DModel


class SD3Adapter(PipelineAdapter):
    """SD3/SD3.5: CLIP-L + CLIP-G + T5 embeddings, CFG with empty-prompt negatives."""

    family = "sd3"
    pipeline_class = StableDiffusion3Pipeline
    keep_high = KEEP_HIGH  # 16-channel VAE latents at 1/8
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    # flow_grpo train_sd3.py / diffusers train_dreambooth_lora_sd3.py: joint attention,
    # image stream (to_*) and context stream (add_*_proj, to_add_out).
    default_lora_targets = (
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    )

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, model_cfg) -> SD3Adapter:
        """Same classes as SD3.5 at toy size: 2 MMDiT blocks with qk RMSNorm, hidden 32."""
        tok, tok_2, tok_3 = tiny.clip_tokenizer(), tiny.clip_tokenizer(), tiny.t5_tokenizer()
        with tiny.seeded(model_cfg.tiny_seed):
            from transformers import CLIPTextModelWithProjection, T5EncoderModel

            text_encoder = CLIPTextModelWithProjection(
                tiny.clip_text_config(tok, hidden=32, projection_dim=32)
            )
            text_encoder_2 = CLIPTextModelWithProjection(
                tiny.clip_text_config(tok_2, hidden=32, projection_dim=32)
            )
            # d_model 64 = the two CLIP sequence embeddings side by side (the pipeline pads
            # the CLIP part up to the T5 width and concatenates along the sequence).
            text_encoder_3 = T5EncoderModel(tiny.t5_config(tok_3, d_model=64))
            vae = tiny.tiny_autoencoder_kl(4, _SD3_VAE_SCALING, _SD3_VAE_SHIFT)
            transformer = SD3Transformer2DModel(
                sample_size=16,
                patch_size=2,
                in_channels=4,
                out_channels=4,
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=64,  # T5 d_model
                caption_projection_dim=32,
                pooled_projection_dim=64,  # two CLIP projections
                pos_embed_max_size=32,
                qk_norm="rms_norm",
            )
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tok,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tok_2,
            text_encoder_3=text_encoder_3,
            tokenizer_3=tok_3,
        )
        return cls(finalize_pipeline(pipe, model_cfg), model_cfg)

    # -- prompts ------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        """The pipeline's encode_prompt; with CFG also the empty-string negatives."""
        embeds, neg_embeds, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=self.do_cfg,
            max_sequence_length=self.cfg.max_sequence_length,
        )
        names = (
            "prompt_embeds",
            "negative_prompt_embeds",
            "pooled_prompt_embeds",
            "negative_pooled_prompt_embeds",
        )
        return self._encoded(names, (embeds, neg_embeds, pooled, neg_pooled))

    # -- latents and schedule -----------------------------------------------------------
    def latent_shape(self) -> tuple[int, ...]:
        vsf = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, self.cfg.height // vsf, self.cfg.width // vsf)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule: ``set_timesteps(N)`` on a fresh copy of its scheduler
        (with ``mu`` only when the config asks for dynamic shifting, as the pipeline does)."""
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        config = scheduler.config
        kwargs = {}
        if config.get("use_dynamic_shifting", False):
            _, h, w = self.latent_shape()
            patch = self.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (h // patch) * (w // patch),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(num_steps, **kwargs)
        return scheduler.sigmas.to(torch.float32).cpu()

    # -- model --------------------------------------------------------------------------
    def _forward(self, transformer, latents, sigma, emb):
        dtype = module_dtype(transformer)
        scale = self.pipe.scheduler.config.num_train_timesteps
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=sigma.float() * scale,  # like the pipeline: fp32 t = sigma * 1000
            encoder_hidden_states=emb["prompt_embeds"].to(dtype),
            pooled_projections=emb["pooled_prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Undo the VAE normalisation (``x / scaling + shift``), decode, map to [0, 1]."""
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0]
        return tiny.to_unit_range(images)
