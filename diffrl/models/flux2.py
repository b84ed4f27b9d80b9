"""FLUX.2 [klein] adapter over diffusers' ``Flux2KleinPipeline``.

FLUX.2 [klein] (Black Forest Labs, January 2026: 4B and 9B, each as a step-distilled
4-step model and an undistilled "base" model) is a rectified-flow transformer
(``Flux2Transformer2DModel``: double-stream blocks, then single-stream blocks whose
attention and MLP projections are fused, with adaLN modulation shared by all blocks)
over the FLUX.2 VAE (``AutoencoderKLFlux2``, 32 channels at 1/8). The prompt goes
through Qwen3's chat template and Qwen3 (4B for klein-4B, 8B for klein-9B); the hidden
states of layers 9, 18 and 27 are concatenated per token (``encode_prompt``).

Latent layout (diffusers ``pipeline_flux2_klein.py``): the VAE latent (32, h, w) is cut
into 2x2 patches, (128, h/2, w/2), normalised per channel by the VAE's batch-norm running
statistics, and flattened to (h/2 * w/2 tokens, 128) with 4-axis position ids (t, y, x,
l); text tokens get ids (0, 0, 0, i). The transformer takes ``timestep = sigma`` (it
multiplies by 1000 itself) and no guidance embedding (``guidance_embeds: false``).

Guidance: the base models use real CFG against the empty prompt, ``v_u + s (v_c - v_u)``;
the distilled models (``is_distilled: true`` in ``model_index.json``) ignore the guidance
scale, as the pipeline does (``do_classifier_free_guidance = guidance_scale > 1 and not
is_distilled``).

Schedule: FlowMatchEuler over ``sigmas = linspace(1, 1/N, N)`` with the exponential time
shift at ``mu = compute_empirical_mu(image_seq_len, N)``, BFL's empirical fit that
depends on the number of steps as well as the resolution (unlike FLUX.1's
``calculate_shift``); the scheduler's ``shift`` / ``base_shift`` / ``max_shift`` are not used.

Deliberate deviations from the pipeline:

* CFG is one batched forward over [uncond; cond] and is combined in fp32 (the pipeline
  makes two calls and combines in the model's dtype), as for every family here;
* the empty negative prompt is encoded once and shared (the pipeline encodes ``""`` once
  per prompt: the same values);
* decoding undoes the batch-norm normalisation in fp32 and then casts to the VAE's
  dtype (the pipeline does it in the text encoder's dtype);
* text-to-image only: reference images (the pipeline's ``image=``) are not supported.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps

from diffrl.models import tiny
from diffrl.models.base import Conditioning
from diffrl.models.loading import PackedLatentAdapter, finalize_pipeline, module_dtype, unwrap

# Qwen3's chat template, reduced to what Flux2KleinPipeline renders (one user message,
# ``add_generation_prompt=True, enable_thinking=False``): the real template gives
# "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n".
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def _tiny_qwen3(tok):
    """Qwen3ForCausalLM (the pipeline's text encoder class) at width 32. 28 layers, so that
    the pipeline's default ``text_encoder_out_layers`` (9, 18, 27) are intermediate layers
    as in Qwen3-4B's 36 (``hidden_states[28]`` would be the final-norm output)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=28,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=2048,
            tie_word_embeddings=True,  # as Qwen3-4B
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )


def _tiny_flux2_vae():
    """AutoencoderKLFlux2 with two small blocks (spatial factor 2) and 4 latent channels
    (16 after the 2x2 patchify), with the real VAE's quant convs and batch norm."""
    return AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
    )


# The layers the low-precision exploration copy and the FP8 flow keep in high precision
# (anchored regexes; why these: diffrl/precision/keep_high.py).
# FLUX.2 (Flux2Transformer2DModel, the klein models): its adaLN modulation is not per
# block but three linears shared by all blocks (each one's output scales every token
# of every block), and its single blocks fuse attention and MLP into
# ``attn.to_qkv_mlp_proj`` / ``attn.to_out``, which are quantized like FLUX.1's
# ``proj_mlp`` / ``proj_out``.
KEEP_HIGH = (
    r"x_embedder",
    r"context_embedder",
    r"time_guidance_embed\..+",  # timestep (and, with guidance_embeds, guidance) embedders
    r"(double_stream_modulation_(img|txt)|single_stream_modulation)\.linear",
    r"norm_out\.linear",
    r"proj_out",  # top level only: single_transformer_blocks.N.attn.to_out is quantized
)


class Flux2Adapter(PackedLatentAdapter):
    """FLUX.2 [klein]: Qwen3 hidden states, patchified + batch-normed packed latents, CFG on
    the base models only."""

    family = "flux2"
    pipeline_class = Flux2KleinPipeline
    # FLUX.2 VAE: 32 channels at 1/8 (patchified 2x2 into 128 channels at 1/16: the same count)
    latent_channels, spatial_downsample = 32, 8
    # CFG runs a negative batch when guidance_scale > 1 on a base model; a distilled model
    # ignores guidance_scale (the adapter does too), so configure those with guidance_scale 1.
    cfg_as_batch = True
    keep_high = KEEP_HIGH
    cond_keys = ("prompt_embeds",)
    # Attention of both streams and both SwiGLU feed-forwards of the double-stream blocks,
    # and the fused QKV+MLP input of the single-stream blocks (DiffSynth-Studio's FLUX.2
    # klein LoRA list; diffusers train_dreambooth_lora_flux2_klein.py trains a subset).
    # The single blocks' fused output ``single_transformer_blocks.N.attn.to_out`` cannot be
    # named by suffix ("attn.to_out" also names the double blocks' ModuleList, which PEFT
    # rejects), so each instance adds it per block (see ``__init__``).
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
    )

    @classmethod
    def latent_numel(cls, model_cfg) -> int:
        """The packed latent's size: the pipeline rounds height and width down to multiples
        of 2 latent elements (16 px) for the 2x2 patchify."""
        patch = 2 * cls.spatial_downsample
        return cls.latent_channels * 4 * (model_cfg.height // patch) * (model_cfg.width // patch)

    def __init__(self, pipe, model_cfg):
        super().__init__(pipe, model_cfg)
        if pipe.config.get("is_distilled", False) and model_cfg.guidance_scale > 1:
            # the pipeline would silently ignore it, and the run plan would count CFG forwards
            from diffrl.schema import ConfigError

            raise ConfigError(
                f"model '{model_cfg.pretrained}' is step-distilled and ignores CFG, but model.guidance_scale "
                f"is {model_cfg.guidance_scale:g}; set model.guidance_scale: 1 (or use a klein base model)"
            )
        # the class's depth-independent targets plus each single block's fused output, as
        # diffusers' klein LoRA script lists them
        singles = unwrap(pipe.transformer).config.num_single_layers
        self.default_lora_targets = type(self).default_lora_targets + tuple(
            f"single_transformer_blocks.{i}.attn.to_out" for i in range(singles)
        )

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, model_cfg) -> Flux2Adapter:
        """Same classes as FLUX.2 [klein] at toy size: 1 double + 2 single blocks, width 32,
        a 28-layer Qwen3 of width 32, a 2-block FLUX.2 VAE. An undistilled (base) model, so
        CFG is exercised; ``pipe.register_to_config(is_distilled=True)`` makes it distilled."""
        tok = tiny.qwen2_tokenizer()
        tok.chat_template = QWEN3_CHAT_TEMPLATE
        with tiny.seeded(model_cfg.tiny_seed):
            text_encoder = _tiny_qwen3(tok)
            vae = _tiny_flux2_vae()
            # the real VAE's statistics are far from (0, 1): give the tiny one some, so that
            # decoding checks the de-normalisation
            channels = vae.bn.num_features
            vae.bn.running_mean.copy_(0.2 * torch.randn(channels))
            vae.bn.running_var.copy_(0.5 + torch.rand(channels))
            transformer = Flux2Transformer2DModel(
                patch_size=1,
                in_channels=16,  # 4 latent channels x 2x2 patchify
                num_layers=1,
                num_single_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=3 * 32,  # three Qwen3 layers concatenated
                axes_dims_rope=(4, 4, 4, 4),  # sums to the head dim, as (32, 32, 32, 32) to 128
                guidance_embeds=False,  # as both klein models
            )
        # FLUX.2's scheduler config (FLUX.1-dev's). Only use_dynamic_shifting (with the
        # exponential time shift) matters: the pipeline passes mu itself.
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        pipe = Flux2KleinPipeline(
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tok,
            transformer=transformer,
            is_distilled=False,
        )
        return cls(finalize_pipeline(pipe, model_cfg), model_cfg)

    @property
    def do_cfg(self) -> bool:
        """As the pipeline: CFG when guidance_scale > 1, except on step-distilled models."""
        return super().do_cfg and not self.pipe.config.get("is_distilled", False)

    # -- prompts ------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        """The pipeline's encode_prompt (chat template, Qwen3 layers 9/18/27); with CFG the
        negatives are the empty prompt, as ``Flux2KleinPipeline.__call__`` uses."""
        max_len = self.cfg.max_sequence_length
        embeds, _text_ids = self.pipe.encode_prompt(prompt=list(prompts), max_sequence_length=max_len)
        out = {"prompt_embeds": embeds}
        if self.do_cfg:
            negative, _ = self.pipe.encode_prompt(prompt=[""], max_sequence_length=max_len)
            out["negative_prompt_embeds"] = negative.expand(len(prompts), -1, -1).clone()
        return Conditioning(out)

    # -- latents and schedule -----------------------------------------------------------
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly Flux2KleinPipeline's schedule: its sigma grid and empirical mu, set through
        the pipeline module's ``retrieve_timesteps`` on a fresh copy of its scheduler."""
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        grid = np.linspace(1.0, 1 / num_steps, num_steps)
        if scheduler.config.get("use_flow_sigmas", False):  # the pipeline drops its grid then
            grid = None
        mu = compute_empirical_mu(image_seq_len=self.latent_shape()[0], num_steps=num_steps)
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=grid, mu=mu)
        return scheduler.sigmas.to(torch.float32).cpu()

    # -- model --------------------------------------------------------------------------
    def _ids(self, prompt_embeds: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(img_ids, txt_ids) from the pipeline's own helpers, for one sample: the
        transformer uses the first sample's ids for the whole batch."""
        h, w = self._latent_hw()
        img_ids = Flux2KleinPipeline._prepare_latent_ids(torch.empty(1, 0, h // 2, w // 2))
        txt_ids = Flux2KleinPipeline._prepare_text_ids(prompt_embeds[:1])
        return img_ids.to(device), txt_ids.to(device)

    def _forward(self, transformer, latents, sigma, emb):
        dtype = module_dtype(transformer)
        prompt_embeds = emb["prompt_embeds"].to(dtype)
        img_ids, txt_ids = self._ids(prompt_embeds, latents.device)
        # Flux2KleinPipeline: t = 1000 sigma cast to the latents' dtype, passed as t / 1000
        scale = self.pipe.scheduler.config.num_train_timesteps
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=(sigma.float() * scale).to(dtype) / scale,
            guidance=None,  # klein has no guidance embedding
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline: tokens back to (128, h/2, w/2), ``x * sqrt(var + eps) + mean``
        with the VAE's batch-norm statistics, 2x2 unpatchify, decode; mapped to [0, 1]."""
        vae = self.pipe.vae
        h, w = self._latent_hw()
        ids = Flux2KleinPipeline._prepare_latent_ids(torch.empty(latents.shape[0], 0, h // 2, w // 2))
        latents = latents.float()
        latents = Flux2KleinPipeline._unpack_latents_with_ids(latents, ids.to(latents.device), h // 2, w // 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, torch.float32)
        var = vae.bn.running_var.view(1, -1, 1, 1).to(latents.device, torch.float32)
        latents = latents * torch.sqrt(var + vae.config.batch_norm_eps) + mean
        latents = Flux2KleinPipeline._unpatchify_latents(latents)
        images = vae.decode(latents.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0]
        return tiny.to_unit_range(images)
