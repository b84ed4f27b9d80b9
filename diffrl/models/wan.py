"""Wan 2.1 text-to-video adapter over diffusers' ``WanPipeline``.

Wan is a video DiT over a causal 3D VAE (AutoencoderKLWan: 8x spatial, 4x temporal
compression, the first frame kept on its own, so ``F_lat = (F - 1) // 4 + 1``),
conditioned on UMT5 states (zero-padded past each prompt's length), with CFG. Latents
are normalised per channel by the VAE's ``latents_mean`` / ``latents_std``.

Schedule: Wan samples with UniPC over flow sigmas (``flow_shift``, 3.0 at 480p and 5.0
at 720p). Our SDE/ODE steps use exactly the pipeline's sigmas (``scheduler_sigmas``: UniPC's
own grid, shift(linspace(1, 1/1000, N + 1)[:-1]) with its first value 1 - 1e-6, then 0).
Deliberate deviation: the transformer gets the continuous timestep ``sigma * 1000``; the
pipeline truncates it to an integer (a change below 1/1000 of the range).
Wan 2.2 features (a second low-noise transformer, per-token timesteps) are not used.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

from diffrl.models import tiny
from diffrl.models.base import Conditioning
from diffrl.models.loading import (
    PipelineAdapter,
    finalize_pipeline,
    module_dtype,
    scheduler_sigmas,
)

# The layers the low-precision exploration copy and the FP8 flow keep in high precision
# (anchored regexes; why these: diffrl/precision/keep_high.py).
KEEP_HIGH = (
    r"patch_embedding",  # Conv3d (never quantized, listed for intent)
    r"condition_embedder\..+",  # time / text (/ image) embedders and time_proj, the adaLN modulation
    r"proj_out",
)


class WanAdapter(PipelineAdapter):
    """Wan 2.1 T2V: UMT5 embeddings, video latents (C, F_lat, h, w), CFG with empty-prompt negatives."""

    family = "wan"
    pipeline_class = WanPipeline
    weight_components = ("transformer",)  # optional to WanPipeline, read here (the preflight's list)
    temporal_downsample = 4  # causal 3D VAE: F_lat = (F - 1) // 4 + 1, 16 channels at 1/8
    keep_high = KEEP_HIGH
    cond_keys = ("prompt_embeds",)
    # diffusers/finetrainers Wan LoRA and flow_grpo train_wan2_1.py: self- and
    # cross-attention projections plus the feed-forward.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, model_cfg) -> WanAdapter:
        """Same classes as Wan2.1-T2V at toy size: 2 blocks, head dim 12, a 4-level VAE of width 8."""
        tok = tiny.t5_tokenizer()
        with tiny.seeded(model_cfg.tiny_seed):
            from transformers import UMT5Config, UMT5EncoderModel

            text_encoder = UMT5EncoderModel(tiny.t5_config(tok, d_model=32, config_class=UMT5Config))
            # Four levels keep the real 8x spatial / 4x temporal factors (the VAE's
            # frame chunking assumes 4x); base_dim 8 keeps it tiny.
            vae = AutoencoderKLWan(
                base_dim=8,
                z_dim=16,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
            )
            transformer = WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=2,
                attention_head_dim=12,
                in_channels=16,
                out_channels=16,
                text_dim=32,  # UMT5 d_model
                freq_dim=32,
                ffn_dim=32,
                num_layers=2,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                rope_max_seq_len=32,
            )
        scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        )
        pipe = WanPipeline(
            tokenizer=tok, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
        )
        return cls(finalize_pipeline(pipe, model_cfg), model_cfg)

    # -- prompts ------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        """The pipeline's encode_prompt (UMT5, zero-padded); negatives are the empty prompt."""
        embeds, neg_embeds = self.pipe.encode_prompt(
            prompts,
            negative_prompt="",
            do_classifier_free_guidance=self.do_cfg,
            max_sequence_length=self.cfg.max_sequence_length,
        )
        return self._encoded(("prompt_embeds", "negative_prompt_embeds"), (embeds, neg_embeds))

    # -- latents and schedule -----------------------------------------------------------
    def latent_frames(self) -> int:
        return (self.cfg.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1

    def latent_shape(self) -> tuple[int, ...]:
        vsf = self.pipe.vae_scale_factor_spatial
        channels = self.transformer.config.in_channels
        return (channels, self.latent_frames(), self.cfg.height // vsf, self.cfg.width // vsf)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline scheduler's own flow-sigma grid (see module doc)."""
        return scheduler_sigmas(self.pipe.scheduler, num_steps)

    # -- model --------------------------------------------------------------------------
    def _forward(self, transformer, latents, sigma, emb):
        dtype = module_dtype(transformer)
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=sigma.float() * self.pipe.scheduler.config.num_train_timesteps,  # as the pipeline: t
            encoder_hidden_states=emb["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Undo the per-channel normalisation (``x * std + mean``), decode, and return
        (B, F, 3, H, W) in [0, 1] (the VAE gives (B, 3, F, H, W))."""
        vae = self.pipe.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device).view(shape)
        latents = latents.float() * std + mean
        video = vae.decode(latents.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0]
        return tiny.to_unit_range(video).permute(0, 2, 1, 3, 4)
