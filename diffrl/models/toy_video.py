"""The ``toy_video`` family: a small pixel-space text-to-video flow model for the
ShapeWorld video world ("a red circle moving left").

It is the Wan 2.1 twin of the image ``toy`` family: the transformer is diffusers'
``WanTransformer3DModel`` (Wan's video DiT with 3D RoPE, cross-attention to the text and
the time-modulated blocks) working directly on clips of 32x32 RGB pixels in [-1, 1], the
text encoder is transformers' ``UMT5EncoderModel`` (Wan's) over the toy's word-level
tokenizer, zero-padded past each prompt as ``WanPipeline`` does, and the schedule is
``FlowMatchEulerDiscreteScheduler`` (shift 1). The one deliberate difference from Wan is
the missing VAE: a causal 3D VAE cannot be trained in minutes on a CPU, and without one
the frames the transformer writes are the frames the reward sees (the image toy drops
SD3's VAE for the same reason). RL on it runs :class:`diffrl.models.wan.WanAdapter`'s
transformer call, LoRA targets and video latent layout (B, C, F, H, W).

The transformer predicts the clean clip (x-prediction, Li & He 2025), as the image toy
does; see :func:`diffrl.models.toy.velocity_from_output`.

``model.pretrained: shapeworld_video`` loads the weights shipped in
``assets/toy_video_model`` (``scripts/pretrain_toy_video.py``; its tokens are tubes of 5
frames x 8 x 8 pixels, see :func:`build_components`); ``tiny`` builds random weights with
one frame per token, which any frame count divides; any other value is a local
``save_pretrained`` directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers.loaders import WanLoraLoaderMixin

from diffrl.models import tiny
from diffrl.models.base import Conditioning, ModelLoadError
from diffrl.models.loading import finalize_pipeline, scheduler_sigmas
from diffrl.models.toy import euler_ode, load_toy, velocity_from_output, word_tokenizer
from diffrl.models.wan import WanAdapter

SHIPPED = Path(__file__).resolve().parents[2] / "assets" / "toy_video_model"
VIDEO_WORDS = ("moving", "up", "down")  # "left" and "right" are image words already
MAX_TOKENS = 8  # "<bos> a red circle moving left <eos>" is 7 tokens


def build_components(
    resolution: int = 32,
    patch: int = 8,
    layers: int = 4,
    heads: int = 4,
    head_dim: int = 24,
    text_hidden: int = 64,
    text_layers: int = 2,
    frame_patch: int = 1,
) -> dict:
    """Fresh (random) components of the toy video architecture; call under ``tiny.seeded``.
    Patches are ``frame_patch`` frames by ``patch`` x ``patch`` pixels, so a 5-frame 32 px
    clip is 80 tokens with one frame per patch. A token of real Wan covers more than one
    frame: its VAE compresses time 4x and space 8x and the DiT patches latents 1 x 2 x 2,
    so one token is a tube of 4 frames x 16 x 16 pixels; ``frame_patch`` > 1 is that tube
    without the VAE (the clip's frames must be a multiple of it)."""
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = word_tokenizer(MAX_TOKENS, extra_words=VIDEO_WORDS)
    text_encoder = UMT5EncoderModel(
        tiny.t5_config(tokenizer, d_model=text_hidden, layers=text_layers, config_class=UMT5Config)
    )
    transformer = WanTransformer3DModel(
        patch_size=(frame_patch, patch, patch),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=3,
        out_channels=3,
        text_dim=text_hidden,
        freq_dim=64,
        ffn_dim=4 * heads * head_dim,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=max(32, resolution // patch),
    )
    return {
        "transformer": transformer,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=1.0),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
    }


class ToyVideoPipeline(DiffusionPipeline, WanLoraLoaderMixin):
    """Pixel-space Wan DiT + UMT5; ``pipe(prompts, num_frames=5)`` returns (B, F, 3, H, W)
    clips in [0, 1]. Saved in model_index.json: ``prediction`` (``x0`` or ``velocity``) and
    ``resolution``, the frame side the model was trained at."""

    model_cpu_offload_seq = "text_encoder->transformer"
    _lora_loadable_modules = ["transformer"]

    def __init__(
        self, transformer, scheduler, text_encoder, tokenizer, prediction: str = "x0", resolution: int = 32
    ):
        super().__init__()
        if prediction not in ("x0", "velocity"):
            raise ValueError(f"ToyVideoPipeline: prediction must be 'x0' or 'velocity', got '{prediction}'")
        self.register_modules(
            transformer=transformer, scheduler=scheduler, text_encoder=text_encoder, tokenizer=tokenizer
        )
        self.register_to_config(prediction=prediction, resolution=int(resolution))

    def velocity(self, x_t, sigma, embeds, transformer=None) -> torch.Tensor:
        """fp32 velocity of clips (B, 3, F, H, W) at ``sigma`` (B,) in [0, 1]."""
        transformer = transformer if transformer is not None else self.transformer
        out = transformer(
            hidden_states=x_t,
            timestep=sigma.float() * self.scheduler.config.num_train_timesteps,
            encoder_hidden_states=embeds,
            return_dict=False,
        )[0]
        return velocity_from_output(out, x_t, sigma, self.config.prediction)

    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """UMT5 states (B, L, D) zeroed past each prompt's tokens, as ``WanPipeline``'s
        ``_get_t5_prompt_embeds``; with gradients if the encoder has them."""
        tokens = self.tokenizer(
            list(prompts),
            padding="max_length",
            truncation=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask.to(self.text_encoder.device)
        states = self.text_encoder(tokens.input_ids.to(mask.device), mask).last_hidden_state
        return states * mask.unsqueeze(-1).to(states.dtype)

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], do_classifier_free_guidance: bool = False):
        """(embeds, negative embeds or None); negatives are the empty prompt."""
        embeds = self.text_embeddings(prompts)
        neg = self.text_embeddings([""] * len(prompts)) if do_classifier_free_guidance else None
        return embeds, neg

    @torch.no_grad()
    def __call__(
        self,
        prompt,
        num_frames: int = 5,
        num_inference_steps: int = 20,
        guidance_scale: float = 1.0,
        generator=None,
        latents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Euler ODE sampling from ``latents`` (default: fresh noise from ``generator``)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        cfg = guidance_scale > 1.0
        embeds, neg = self.encode_prompt(prompts, cfg)
        if latents is None:
            side = self.config.resolution
            latents = torch.randn((len(prompts), 3, num_frames, side, side), generator=generator)
        x = latents.to(self.transformer.device, torch.float32)
        self.scheduler.set_timesteps(num_inference_steps)

        def velocity(x, sigma, conditional):
            return self.velocity(x, sigma, embeds if conditional else neg)

        x = euler_ode(x, self.scheduler.sigmas.float(), velocity, guidance_scale)
        return tiny.to_unit_range(x).permute(0, 2, 1, 3, 4)


class ToyVideoAdapter(WanAdapter):
    """Flow-RL adapter of :class:`ToyVideoPipeline`: Wan's transformer call and LoRA targets
    (inherited), latents are the clip's pixels (3, F, H, W), no temporal compression."""

    family = "toy_video"
    pipeline_class = ToyVideoPipeline
    latent_channels, spatial_downsample, temporal_downsample = 3, 1, 1  # pixels, every frame

    @classmethod
    def build_tiny(cls, model_cfg) -> ToyVideoAdapter:
        """The toy video architecture with random weights, smaller (for tests)."""
        with tiny.seeded(model_cfg.tiny_seed):
            comps = build_components(
                resolution=model_cfg.height, layers=2, heads=2, head_dim=12, text_hidden=32, text_layers=1
            )
        pipe = ToyVideoPipeline(**comps, prediction="x0", resolution=model_cfg.height)
        return cls(finalize_pipeline(pipe, model_cfg), model_cfg)

    @classmethod
    def from_pretrained(cls, model_cfg) -> ToyVideoAdapter:
        """``shapeworld_video`` = the shipped weights; otherwise a ``save_pretrained`` directory."""
        adapter = load_toy(
            super().from_pretrained,
            model_cfg,
            "shapeworld_video",
            SHIPPED,
            "scripts/pretrain_toy_video.py",
            lambda adapter: adapter.pipe.config.resolution,
        )
        tube = adapter.pipe.transformer.config.patch_size[0]
        if model_cfg.num_frames % tube:
            raise ModelLoadError(
                f"model '{model_cfg.pretrained}' turns {tube} frames into one token; "
                f"set model.num_frames to a multiple of {tube} (it is {model_cfg.num_frames})"
            )
        return adapter

    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        return self._encoded(
            ("prompt_embeds", "negative_prompt_embeds"), self.pipe.encode_prompt(prompts, self.do_cfg)
        )

    def latent_frames(self) -> int:
        return self.cfg.num_frames

    def latent_shape(self) -> tuple[int, ...]:
        return (3, self.cfg.num_frames, self.cfg.height, self.cfg.width)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return scheduler_sigmas(self.pipe.scheduler, num_steps)

    def _forward(self, transformer, latents, sigma, emb):
        """Wan's transformer call, with x0-predictions turned into velocities."""
        out = super()._forward(transformer, latents, sigma, emb)
        return velocity_from_output(out, latents, sigma, self.pipe.config.prediction)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixel space: (B, 3, F, H, W) in [-1, 1] to (B, F, 3, H, W) in [0, 1]."""
        return tiny.to_unit_range(latents).permute(0, 2, 1, 3, 4)


__all__ = ["SHIPPED", "ToyVideoAdapter", "ToyVideoPipeline", "build_components"]
