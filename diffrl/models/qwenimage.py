"""Qwen-Image adapter over diffusers' ``QwenImagePipeline``.

Qwen-Image (Qwen team, "Qwen-Image Technical Report", 2025) is a 20B double-stream
MMDiT (60 blocks, separate image and text weights, joint attention with 3D "MSRoPE")
over the 16-channel Wan-2.1-style causal 3D VAE (8x spatial, one latent frame for an
image), conditioned on the last hidden states of Qwen2.5-VL-7B. The prompt is wrapped in
a chat template whose system prefix (34 tokens) is dropped after encoding, and the
padded positions carry an attention mask (``prompt_embeds_mask``). Latents are packed
2x2 like FLUX: (h/2 * w/2 tokens, 4 * 16 channels), normalised per channel by the VAE's
``latents_mean`` / ``latents_std``.

Guidance is "true CFG" with a negative prompt (``true_cfg_scale``; this adapter's
``guidance_scale``), and the pipeline rescales the combined prediction per token to the
norm of the conditional one: ``v = comb * ||v_c|| / ||comb||`` over the channel axis
(diffusers ``pipeline_qwenimage.py``). The negative prompt is ``" "``: a ``None``
negative disables CFG in the pipeline, and flow_grpo's Qwen-Image scripts pass ``" "``.

Schedule: FlowMatchEuler with ``sigmas = linspace(1, 1/N, N)``, the resolution-dependent
*exponential* shift ``sigma' = e^mu / (e^mu + 1/sigma - 1)`` with ``mu`` linear in the
packed image sequence length (256 -> 0.5, 8192 -> 0.9), then stretched so that the last
nonzero sigma is ``shift_terminal = 0.02`` (the published scheduler config of
Qwen/Qwen-Image), then a final 0.

Deliberate deviations:

* with one step the stretch is 0/0 and the pipeline's schedule is NaN; ``sigmas(1)`` is
  [1, 0] (one Euler step from noise to the sample);
* the CFG combination and the norm rescale are computed in fp32 (the pipeline does them in
  the transformer's dtype, bf16 in practice); identical in fp32;
* prompt embeddings are zero-padded (mask 0) to ``max_sequence_length``, where the
  pipeline pads to the longest prompt of its batch: cached prompts from different
  batches then concatenate, and every forward has the same shapes (torch.compile, CUDA
  graphs). Masked text tokens take no part in the image tokens' attention and the valid
  ones keep their RoPE positions, so the velocity is the pipeline's; the padding only
  costs text-stream compute, so keep ``max_sequence_length`` near the longest prompt
  (its tokens plus the template's 5 closing tokens).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from diffrl.models import tiny
from diffrl.models.base import Conditioning
from diffrl.models.loading import PackedLatentAdapter, finalize_pipeline, module_dtype

# scheduler/scheduler_config.json of Qwen/Qwen-Image (diffusers layout)
QWEN_IMAGE_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)

# The first four channels of the real VAE's per-channel statistics (vae/config.json of
# Qwen/Qwen-Image), so that the tiny twin's decode exercises the de-normalisation.
_TINY_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075]
_TINY_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558]
# Text-encoder vocabulary of the tiny twin: fixed (not len(tokenizer)) so that the
# full-size architecture file can repeat it in its widened text config.
TINY_TEXT_VOCAB = 1024


def tiny_text_encoder_config(tok, vocab_size: int = TINY_TEXT_VOCAB):
    """Qwen2.5-VL config at toy size: one text layer of width 32 (head dim 16, M-RoPE
    sections 2+3+3) and a one-block vision tower (never run for text-to-image)."""
    from transformers import Qwen2_5_VLConfig

    if len(tok) > vocab_size:
        raise ValueError(
            f"tiny Qwen2 tokenizer has {len(tok)} tokens, more than the text encoder's {vocab_size}"
        )
    ids = tok.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=32,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def _pad_to(embeds: torch.Tensor, mask: torch.Tensor | None, length: int):
    """Zero-pad (B, L, D) embeddings and their (B, L) mask (all ones when None) to ``length``."""
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    extra = length - embeds.shape[1]
    if extra > 0:
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, extra))
        mask = torch.nn.functional.pad(mask, (0, extra))
    return embeds, mask


# The layers the low-precision exploration copy and the FP8 flow keep in high precision
# (anchored regexes; why these: diffrl/precision/keep_high.py).
# Qwen-Image (QwenImageTransformer2DModel: text-to-image and edit pipelines alike)
KEEP_HIGH = (
    r"img_in",  # latent (packed 2x2 patch) embedder
    r"txt_in",  # Qwen2.5-VL hidden states into the text stream
    r"time_text_embed\..+",  # timestep embedder (linear_1, linear_2)
    r"transformer_blocks\.\d+\.(img|txt)_mod\.1",  # adaLN modulation of both streams
    r"norm_out\.linear",
    r"proj_out",
)


class QwenImageAdapter(PackedLatentAdapter):
    """Qwen-Image: Qwen2.5-VL embeddings + mask, packed latents, true CFG with a norm rescale."""

    family = "qwenimage"
    pipeline_class = QwenImagePipeline
    # 16-channel VAE latents at 1/8 (packed 2x2 into 64 channels at 1/16: the same count)
    keep_high = KEEP_HIGH
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")
    masks_text_tokens = True  # embeddings padded to max_sequence_length, with their mask
    # flow_grpo's Qwen-Image scripts (as diffusers' _tp_plan lists them): attention of
    # both streams and both streams' feed-forwards.
    default_lora_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    negative_prompt = " "

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, model_cfg) -> QwenImageAdapter:
        """Same classes as Qwen-Image at toy size: 2 blocks of width 32, a 2-level VAE (factor 2,
        4 channels), a 1-layer Qwen2.5-VL text encoder."""
        from transformers import Qwen2_5_VLForConditionalGeneration

        tok = tiny.qwen2_tokenizer()
        with tiny.seeded(model_cfg.tiny_seed):
            text_encoder = Qwen2_5_VLForConditionalGeneration(tiny_text_encoder_config(tok))
            vae = AutoencoderKLQwenImage(
                base_dim=8,
                z_dim=4,
                dim_mult=[1, 2],
                num_res_blocks=1,
                temperal_downsample=[False],
                latents_mean=_TINY_LATENTS_MEAN,
                latents_std=_TINY_LATENTS_STD,
            )
            transformer = QwenImageTransformer2DModel(
                patch_size=2,
                in_channels=16,  # 4 latent channels x 2x2 packing
                out_channels=4,
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=32,  # text encoder hidden size
                axes_dims_rope=(4, 6, 6),
            )
        pipe = QwenImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tok,
            transformer=transformer,
        )
        return cls(finalize_pipeline(pipe, model_cfg), model_cfg)

    # -- prompts ------------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.cfg.max_sequence_length
        embeds, mask = self.pipe.encode_prompt(prompts, max_sequence_length=length)
        return _pad_to(embeds, mask, length)

    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        """The pipeline's encode_prompt (template, last hidden states, system prefix dropped),
        padded to ``max_sequence_length``; the negative is the prompt ``" "``."""
        embeds, mask = self._encode(prompts)
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if self.do_cfg:
            neg, neg_mask = self._encode([self.negative_prompt])
            out["negative_prompt_embeds"] = neg.expand(len(prompts), -1, -1)
            out["negative_prompt_embeds_mask"] = neg_mask.expand(len(prompts), -1)
        return Conditioning(out)

    # -- latents and schedule -----------------------------------------------------------
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly QwenImagePipeline's schedule: sigmas=linspace(1, 1/N, N) and mu from the image
        sequence length, through a fresh FlowMatchEuler scheduler built from the pipeline's
        (exponential shift, then the stretch to ``shift_terminal``). One step: [1, 0] (see
        the module doc)."""
        if num_steps == 1:
            return torch.tensor([1.0, 0.0])
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config)
        config = scheduler.config
        mu = calculate_shift(
            self.latent_shape()[0],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return scheduler.sigmas.to(torch.float32).cpu()

    # -- model --------------------------------------------------------------------------
    def _forward(self, transformer, latents, sigma, emb):
        dtype = module_dtype(transformer)
        h, w = self._latent_hw()
        # QwenImagePipeline casts t = 1000 sigma to the latents' dtype, then passes t / 1000
        scale = self.pipe.scheduler.config.num_train_timesteps
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=(sigma.float() * scale).to(dtype) / scale,
            guidance=None,  # Qwen-Image is not guidance-distilled
            encoder_hidden_states=emb["prompt_embeds"].to(dtype),
            encoder_hidden_states_mask=emb["prompt_embeds_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * latents.shape[0],
            return_dict=False,
        )[0]

    def _combine_cfg(self, v_uncond, v_cond, sigma) -> torch.Tensor:
        """QwenImagePipeline's true CFG, in fp32: ``comb = v_u + s (v_c - v_u)``, rescaled per
        token to the conditional norm, ``v = comb * ||v_c|| / ||comb||`` (norms over the packed
        channel axis)."""
        comb = super()._combine_cfg(v_uncond, v_cond, sigma)
        return comb * (v_cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Unpack to the VAE's (B, C, 1, h, w) video layout, undo the per-channel normalisation
        (``x * std + mean``), decode, keep the single frame, map to [0, 1]."""
        vae = self.pipe.vae
        latents = QwenImagePipeline._unpack_latents(
            latents, self.cfg.height, self.cfg.width, self.pipe.vae_scale_factor
        )
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device).view(shape)
        latents = latents.float() * std + mean
        images = vae.decode(latents.to(device=vae.device, dtype=vae.dtype), return_dict=False)[0]
        return tiny.to_unit_range(images[:, :, 0])
