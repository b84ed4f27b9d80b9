"""The ``toy`` family: a small pixel-space text-to-image flow model for ShapeWorld.

The classes are real library classes, so RL on the toy exercises the same code paths
as on SD3: the transformer is diffusers' ``SD3Transformer2DModel`` (an MMDiT) working
directly on 32x32 RGB pixels in [-1, 1] (no VAE), the text encoder is transformers'
``CLIPTextModelWithProjection`` over a word-level tokenizer built in memory, and the
schedule is ``FlowMatchEulerDiscreteScheduler``. :class:`ToyPipeline` is a diffusers
pipeline (save/load with ``save_pretrained``/``from_pretrained``, LoRA with
``load_lora_weights``) and samples with the Euler ODE when called.

``model.pretrained: shapeworld`` loads the weights shipped in ``assets/toy_model``
(trained by ``scripts/pretrain_toy.py``); ``tiny`` builds the same architecture with
random weights; any other value is a local directory written by ``save_pretrained``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from diffusers.loaders import SD3LoraLoaderMixin

from diffrl.models import tiny
from diffrl.models.base import Conditioning, ModelLoadError
from diffrl.models.loading import finalize_pipeline
from diffrl.models.sd3 import SD3Adapter

SHIPPED = Path(__file__).resolve().parents[2] / "assets" / "toy_model"
# the late-step world's base (textured objects: diffrl/toy/late_world.py)
SHIPPED_LATE = SHIPPED.with_name("toy_model_late")
# the few-step base: the shipped one distilled by reflow (diffrl/toy/reflow.py)
SHIPPED_FEWSTEP = SHIPPED.with_name("toy_model_fewstep")
# model.pretrained name -> (folder, the command that makes it)
SHIPPED_TOYS = {
    "shapeworld": (SHIPPED, "scripts/pretrain_toy.py"),
    "shapeworld_late": (
        SHIPPED_LATE,
        "scripts/pretrain_toy.py --world late (assets/toy_model_late/README.md)",
    ),
    "shapeworld_fewstep": (SHIPPED_FEWSTEP, "scripts/distill_toy.py (assets/toy_model_fewstep/README.md)"),
}
_SPECIAL = ("<pad>", "<unk>", "<bos>", "<eos>")  # eos id 3: CLIP pools at the first eos
_WORDS = (
    "a an one two three four and to the left right of above below red green blue yellow purple "
    "cyan circle circles square squares triangle triangles"
).split()


def word_tokenizer(max_length: int = 16, extra_words: tuple[str, ...] = ()):
    """Word-level tokenizer (lowercased, whitespace/punctuation split) wrapped as a
    ``PreTrainedTokenizerFast``: ``<bos> words <eos>`` padded to ``max_length``.
    ``extra_words`` extend the vocabulary after the image words (the video world's
    "moving up"), so the image model's ids stay as they were."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIAL + tuple(_WORDS) + tuple(extra_words))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def build_components(
    resolution: int = 32,
    patch: int = 8,
    layers: int = 4,
    heads: int = 4,
    head_dim: int = 32,
    text_hidden: int = 64,
    text_layers: int = 2,
    qk_norm: str | None = None,
) -> dict:
    """Fresh (random) components of the toy architecture; call under ``tiny.seeded``.
    ``qk_norm`` ("rms_norm", as SD3.5) normalises attention queries and keys."""
    from transformers import CLIPTextModelWithProjection

    tokenizer = word_tokenizer()
    text_encoder = CLIPTextModelWithProjection(
        tiny.clip_text_config(tokenizer, hidden=text_hidden, layers=text_layers, projection_dim=text_hidden)
    )
    transformer = SD3Transformer2DModel(
        sample_size=resolution,
        patch_size=patch,
        in_channels=3,
        out_channels=3,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_hidden,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=text_hidden,
        pos_embed_max_size=resolution // patch,
        qk_norm=qk_norm,
    )
    return {
        "transformer": transformer,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=1.0),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
    }


# x-prediction divides by sigma; below this the division is clamped (JiT, Li & He 2025).
MIN_SIGMA = 0.05


def velocity_from_output(
    output: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor, prediction: str
) -> torch.Tensor:
    """The flow velocity v = eps - x0 (fp32) from the transformer's raw output.

    With ``prediction == "x0"`` the transformer predicts the clean image and
    v = (x_t - x0_hat) / max(sigma, MIN_SIGMA), since x_t = x0 + sigma (eps - x0). A
    patch-8 pixel transformer with a 128-wide token cannot carry the 192 noise values of
    its patch, so eps/v-prediction leaves the noise in; predicting x0 (which lies on a
    low-dimensional manifold) does not (Li & He 2025, "Back to Basics: Let Denoising
    Generative Models Denoise", Sec. 3).
    """
    if prediction == "velocity":
        return output.float()
    s = sigma.float().clamp(min=MIN_SIGMA).view(-1, *([1] * (x_t.ndim - 1)))
    return (x_t.float() - output.float()) / s


def euler_ode(x: torch.Tensor, sigmas: torch.Tensor, velocity, guidance_scale: float = 1.0) -> torch.Tensor:
    """Euler steps of the flow ODE over ``sigmas`` (the scheduler's grid, ending at 0) from
    ``x``; ``velocity(x, sigma, conditional)`` is the model's velocity with the prompt or,
    when ``guidance_scale`` > 1, also without it for classifier-free guidance."""
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        sigma = torch.full((x.shape[0],), float(s), device=x.device)
        v = velocity(x, sigma, True)
        if guidance_scale > 1.0:
            v_u = velocity(x, sigma, False)
            v = v_u + guidance_scale * (v - v_u)
        x = x + (s_next - s) * v
    return x


class ToyPipeline(DiffusionPipeline, SD3LoraLoaderMixin):
    """Pixel-space MMDiT + CLIP text encoder; ``pipe(prompts)`` returns PIL images.

    ``prediction`` (saved in model_index.json) is what the transformer outputs:
    ``x0`` (the shipped model) or ``velocity``.
    """

    model_cpu_offload_seq = "text_encoder->transformer"
    _lora_loadable_modules = ["transformer"]

    def __init__(self, transformer, scheduler, text_encoder, tokenizer, prediction: str = "velocity"):
        super().__init__()
        if prediction not in ("x0", "velocity"):
            raise ValueError(f"ToyPipeline: prediction must be 'x0' or 'velocity', got '{prediction}'")
        self.register_modules(
            transformer=transformer, scheduler=scheduler, text_encoder=text_encoder, tokenizer=tokenizer
        )
        self.register_to_config(prediction=prediction)

    def velocity(self, x_t, sigma, embeds, pooled, transformer=None) -> torch.Tensor:
        """fp32 velocity at ``sigma`` (B,) in [0, 1]; ``transformer`` defaults to the pipeline's."""
        transformer = transformer if transformer is not None else self.transformer
        t = sigma.float() * self.scheduler.config.num_train_timesteps
        out = transformer(
            hidden_states=x_t,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            timestep=t,
            return_dict=False,
        )[0]
        return velocity_from_output(out, x_t, sigma, self.config.prediction)

    def load_lora_weights(self, pretrained_model_name_or_path_or_dict, adapter_name=None, **kwargs):
        """Load a transformer LoRA (SD3 format; the text encoder is never trained here, and
        SD3's loader would look for a second text encoder this pipeline does not have)."""
        kwargs["return_lora_metadata"] = True
        state, metadata = self.lora_state_dict(pretrained_model_name_or_path_or_dict, **kwargs)
        self.load_lora_into_transformer(
            state, transformer=self.transformer, adapter_name=adapter_name, metadata=metadata, _pipeline=self
        )

    def text_embeddings(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence (B, L, D), pooled projection (B, D)) with gradients if the encoder has them."""
        ids = self.tokenizer(prompts, padding="max_length", truncation=True, return_tensors="pt").input_ids
        out = self.text_encoder(ids.to(self.text_encoder.device))
        return out.last_hidden_state, out.text_embeds

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], do_classifier_free_guidance: bool = False):
        """(embeds, negative embeds or None, pooled, negative pooled or None); negatives are
        the empty prompt, which pretraining drops captions to."""
        embeds, pooled = self.text_embeddings(prompts)
        if not do_classifier_free_guidance:
            return embeds, None, pooled, None
        neg, neg_pooled = self.text_embeddings([""] * len(prompts))
        return embeds, neg, pooled, neg_pooled

    @torch.no_grad()
    def __call__(
        self,
        prompt,
        num_inference_steps: int = 20,
        guidance_scale: float = 1.0,
        generator=None,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
    ):
        """Euler ODE sampling from ``latents`` (default: fresh noise from ``generator``);
        ``output_type`` ``pil`` or ``pt`` ([0, 1])."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        cfg = guidance_scale > 1.0
        embeds, neg, pooled, neg_pooled = self.encode_prompt(prompts, cfg)
        size = self.transformer.config.sample_size
        x = (
            latents
            if latents is not None
            else torch.randn((len(prompts), 3, size, size), generator=generator)
        )
        x = x.to(self.transformer.device, torch.float32)
        self.scheduler.set_timesteps(num_inference_steps)

        def velocity(x, sigma, conditional):
            return self.velocity(x, sigma, *((embeds, pooled) if conditional else (neg, neg_pooled)))

        x = euler_ode(x, self.scheduler.sigmas.float(), velocity, guidance_scale)
        images = tiny.to_unit_range(x)
        if output_type == "pt":
            return images
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor.numpy_to_pil(images.permute(0, 2, 3, 1).cpu().numpy())


@contextlib.contextmanager
def _quiet_loading():
    """Turn off diffusers' and transformers' loading progress bars, then restore them."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    d_on, t_on = dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled()
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if d_on:
            dlog.enable_progress_bar()
        if t_on:
            tlog.enable_progress_bar()


def load_toy(load, model_cfg, shipped_name: str, shipped: Path, rebuild: str, side_of):
    """A toy adapter from ``load(model_cfg)``, where ``model.pretrained: <shipped_name>``
    means the weights shipped in ``shipped`` (one error naming ``rebuild`` when they are
    missing), with the loaders' progress bars off (a few MB load in a blink) and one error
    when ``model.height`` / ``model.width`` differ from ``side_of(adapter)``, the square
    frame side the model was trained at."""
    if model_cfg.pretrained == shipped_name:
        if not (shipped / "model_index.json").is_file():
            raise ModelLoadError(
                f"the shipped {shipped_name} model is missing from '{shipped}'; restore "
                f"{shipped.relative_to(shipped.parents[1])} from git or rebuild it with {rebuild}"
            )
        model_cfg = dataclasses.replace(model_cfg, pretrained=str(shipped))
    with _quiet_loading():
        adapter = load(model_cfg)
    side = side_of(adapter)
    if (model_cfg.height, model_cfg.width) != (side, side):
        raise ModelLoadError(
            f"toy model '{model_cfg.pretrained}' generates {side}x{side} pixels; set "
            f"model.height and model.width to {side}"
        )
    return adapter


class ToyAdapter(SD3Adapter):
    """Flow-RL adapter of :class:`ToyPipeline`; the transformer call, schedule and LoRA
    targets are SD3's (same class); latents are pixels."""

    family = "toy"
    pipeline_class = ToyPipeline
    latent_channels, spatial_downsample = 3, 1  # RGB pixels, no VAE

    @classmethod
    def build_tiny(cls, model_cfg) -> ToyAdapter:
        """The toy architecture with random weights (smaller, for tests)."""
        with tiny.seeded(model_cfg.tiny_seed):
            comps = build_components(
                resolution=model_cfg.height, layers=2, heads=2, text_hidden=32, text_layers=1
            )
        return cls(finalize_pipeline(ToyPipeline(**comps, prediction="x0"), model_cfg), model_cfg)

    @classmethod
    def from_pretrained(cls, model_cfg) -> ToyAdapter:
        """``shapeworld`` = the shipped weights, ``shapeworld_late`` the late-step world's,
        ``shapeworld_fewstep`` the few-step one; otherwise a directory from ``save_pretrained``."""
        name = model_cfg.pretrained if model_cfg.pretrained in SHIPPED_TOYS else "shapeworld"
        folder, how = SHIPPED_TOYS[name]
        return load_toy(
            super().from_pretrained,
            model_cfg,
            name,
            folder,
            how,
            lambda adapter: adapter.transformer.config.sample_size,
        )

    def _forward(self, transformer, latents, sigma, emb):
        """SD3's transformer call, with x0-predictions turned into velocities."""
        out = super()._forward(transformer, latents, sigma, emb)
        return velocity_from_output(out, latents, sigma, self.pipe.config.prediction)

    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        names = (
            "prompt_embeds",
            "negative_prompt_embeds",
            "pooled_prompt_embeds",
            "negative_pooled_prompt_embeds",
        )
        return self._encoded(names, self.pipe.encode_prompt(prompts, self.do_cfg))

    def latent_shape(self) -> tuple[int, ...]:
        return (3, self.cfg.height, self.cfg.width)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixel space: the latents are the image in [-1, 1]."""
        return tiny.to_unit_range(latents)


__all__ = ["SHIPPED", "ToyAdapter", "ToyPipeline", "build_components", "word_tokenizer"]
