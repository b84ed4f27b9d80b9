"""SANA adapter over diffusers' ``SanaPipeline``.

SANA (Xie et al. 2024) is a linear-attention DiT over a deep-compression autoencoder
(DC-AE, 32x), conditioned on Gemma-2 hidden states with an attention mask, with CFG.

Schedule: SanaPipeline samples with DPM-Solver++ over *flow* sigmas
(``use_flow_sigmas=True``, ``flow_shift``). Our SDE/ODE steps are Euler-type steps on
the same flow at exactly the pipeline's sigmas (``scheduler_sigmas``: the scheduler's own
``set_timesteps`` grid, which starts at shift(1 - 1/1000), 0.9997 at shift 3, and ends at
0). Deliberate deviation: the transformer gets the continuous timestep
``sigma * 1000 * timestep_scale``; the pipeline passes the scheduler's int64 timesteps,
truncated (999 for 999.67), a change below 1/1000 of the timestep range.
"""

from __future__ import annotations

import inspect

import torch
from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

from diffrl.models import tiny
from diffrl.models.base import Conditioning
from diffrl.models.loading import (
    PipelineAdapter,
    finalize_pipeline,
    module_dtype,
    scheduler_sigmas,
    unwrap,
)


def _tiny_gemma2(tok):
    """One-layer Gemma-2 text encoder sized to the tiny tokenizer."""
    from transformers import Gemma2Config, Gemma2Model

    return Gemma2Model(
        Gemma2Config(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=2048,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )


def _tiny_dc_ae():
    """Two-stage DC-AE (ResBlock + EfficientViT linear attention), spatial factor 2."""
    return AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,  # real SANA DC-AE f32c32
    )


# The layers the low-precision exploration copy and the FP8 flow keep in high precision
# (anchored regexes; why these: diffrl/precision/keep_high.py).
KEEP_HIGH = (
    r"patch_embed\.proj",  # a 1x1 conv when patch_size is 1: quantizable, so listed
    r"time_embed\..+",  # AdaLayerNormSingle: timestep embedder + the shared adaLN-single linear
    r"caption_projection\..+",
    r"proj_out",
)


class SanaAdapter(PipelineAdapter):
    """SANA: Gemma-2 embeddings + mask, AutoencoderDC latents, CFG with empty-prompt negatives."""

    family = "sana"
    pipeline_class = SanaPipeline
    latent_channels, spatial_downsample = 32, 32  # DC-AE
    keep_high = KEEP_HIGH
    cond_keys = ("prompt_embeds", "prompt_attention_mask")
    # Self (linear) and cross attention projections, plus the 1x1 convolutions of the
    # GLUMBConv feed-forward (its small depthwise 3x3 conv stays frozen).
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "ff.conv_inverted", "ff.conv_point")
    # SanaPipeline.__call__ prepends its "complex human instruction" to every prompt by
    # default; SANA was trained that way, so the adapter does the same.
    use_complex_human_instruction = True

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, model_cfg) -> SanaAdapter:
        """Same classes as SANA at toy size: 2 blocks, 2-block DC-AE (factor 2), 1-layer Gemma-2."""
        tok = tiny.gemma_tokenizer()
        with tiny.seeded(model_cfg.tiny_seed):
            text_encoder = _tiny_gemma2(tok)
            vae = _tiny_dc_ae()
            transformer = SanaTransformer2DModel(
                in_channels=4,
                out_channels=4,
                num_attention_heads=2,
                attention_head_dim=16,
                num_layers=2,
                num_cross_attention_heads=2,
                cross_attention_head_dim=16,
                cross_attention_dim=32,
                caption_channels=32,  # Gemma hidden size
                sample_size=16,
                patch_size=1,
            )
        scheduler = DPMSolverMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        )
        pipe = SanaPipeline(
            tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
        )
        return cls(finalize_pipeline(pipe, model_cfg), model_cfg)

    # -- prompts ------------------------------------------------------------------------
    def _instruction(self):
        if not self.use_complex_human_instruction:
            return None
        params = inspect.signature(type(self.pipe).__call__).parameters
        param = params.get("complex_human_instruction")
        return None if param is None else param.default

    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        """The pipeline's encode_prompt (Gemma-2 states + mask); negatives are the empty prompt."""
        embeds, mask, neg_embeds, neg_mask = self.pipe.encode_prompt(
            prompts,
            do_classifier_free_guidance=self.do_cfg,
            negative_prompt="",
            max_sequence_length=self.cfg.max_sequence_length,
            complex_human_instruction=self._instruction(),
        )
        names = (
            "prompt_embeds",
            "prompt_attention_mask",
            "negative_prompt_embeds",
            "negative_prompt_attention_mask",
        )
        return self._encoded(names, (embeds, mask, neg_embeds, neg_mask))

    # -- latents and schedule -----------------------------------------------------------
    def latent_shape(self) -> tuple[int, ...]:
        vsf = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, self.cfg.height // vsf, self.cfg.width // vsf)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline scheduler's own flow-sigma grid (see module doc)."""
        return scheduler_sigmas(self.pipe.scheduler, num_steps)

    # -- model --------------------------------------------------------------------------
    def _forward(self, transformer, latents, sigma, emb):
        config = unwrap(transformer).config
        dtype = module_dtype(transformer)
        # SanaPipeline: timestep = t * timestep_scale with t = sigma * num_train_timesteps
        timestep = sigma.float() * self.pipe.scheduler.config.num_train_timesteps * config.timestep_scale
        out = transformer(
            latents.to(dtype),
            encoder_hidden_states=emb["prompt_embeds"].to(dtype),
            encoder_attention_mask=emb["prompt_attention_mask"],
            timestep=timestep,
            return_dict=False,
        )[0]
        if config.out_channels is not None and config.out_channels == 2 * config.in_channels:
            out = out.chunk(2, dim=1)[0]  # learned sigma: the first half is the velocity
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``vae.decode(x / scaling_factor)`` (DC-AE has no shift), mapped to [0, 1]."""
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor
        images = vae.decode(latents.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0]
        return tiny.to_unit_range(images)
