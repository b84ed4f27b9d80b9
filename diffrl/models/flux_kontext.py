"""FLUX.1 Kontext adapter: instruction-based image editing over ``FluxKontextPipeline``.

FLUX.1 Kontext (Black Forest Labs, "FLUX.1 Kontext: Flow Matching for In-Context Image
Generation and Editing in Latent Space", 2025) is FLUX.1's transformer trained to edit:
the input image is VAE-encoded, packed like the target latents, and appended to the
image tokens, with position ids whose first axis is 1 instead of 0 (sec. 3: "a constant
offset ... virtual time step"). The transformer's output for the appended tokens is
dropped; the target tokens' output is the velocity (diffusers
``pipeline_flux_kontext.py``: ``torch.cat([latents, image_latents], dim=1)`` and
``noise_pred[:, :latents.size(1)]``). Guidance is FLUX.1-dev's embedding, schedule and
text encoders are FLUX.1's (:mod:`diffrl.models.flux`).

Each prompt is an :class:`~rewards.prompts.EditPrompt`: the instruction plus its input
image. The image's packed latents are part of the prompt's conditioning
(``image_latents``) and are cached with it, so each input image is encoded once.

Deliberate deviation: the input image is resized to the run's ``height`` x ``width``
(Lanczos, as diffusers' image processor), not to the pipeline's nearest "preferred
Kontext resolution" (``_auto_resize``): RL generates at one fixed size, and equal input
and output sizes keep one token layout per run.
"""

from __future__ import annotations

import torch
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import retrieve_latents

from diffrl.data.prompts import PromptFileError
from diffrl.models.base import Conditioning
from diffrl.models.flux import FluxAdapter
from diffrl.models.loading import module_dtype, unwrap
from rewards.prompts import EditPrompt, load_image


class FluxKontextAdapter(FluxAdapter):
    """FLUX.1 Kontext [dev]: FLUX.1 plus the input image's latents as extra image tokens."""

    family = "flux_kontext"
    pipeline_class = FluxKontextPipeline
    edits_images = True
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds", "image_latents")

    # -- prompts ------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        """FLUX.1's text conditioning plus each prompt's input image, encoded as the
        pipeline does: [-1, 1], the VAE posterior's mode, ``(x - shift) * scaling``, packed."""
        missing = [p for p in prompts if not isinstance(p, EditPrompt)]
        if missing:
            raise PromptFileError(
                f"flux_kontext edits images, but prompt {str(missing[0])!r} has no input image; "
                "give the prompt file an 'image' column (.jsonl)"
            )
        cond = self._encode_text(prompts)
        cond.tensors["image_latents"] = self._image_latents([p.image for p in prompts])
        return cond

    def _encode_text(self, prompts: list[str]) -> Conditioning:
        """FLUX.1's pooled CLIP + T5 conditioning (the part a ``random:`` build on the meta
        device takes from its CPU text encoders; the images go through its own VAE)."""
        return super()._encode_uncached(prompts)

    def _image_latents(self, paths: list[str]) -> torch.Tensor:
        vae = self.pipe.vae
        pixels = torch.stack([load_image(p, (self.cfg.height, self.cfg.width), "lanczos") for p in paths])
        pixels = (2 * pixels - 1).to(device=vae.device, dtype=vae.dtype)
        latents = retrieve_latents(vae.encode(pixels), sample_mode="argmax")
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        batch, channels, h, w = latents.shape
        return FluxKontextPipeline._pack_latents(latents, batch, channels, h, w)

    # -- model --------------------------------------------------------------------------
    def _forward(self, transformer, latents, sigma, emb):
        """The target tokens, then the input image's, with ids (0, y, x) and (1, y, x)."""
        config = unwrap(transformer).config
        dtype = module_dtype(transformer)
        batch, tokens = latents.shape[:2]
        h, w = self._latent_hw()
        ids = FluxKontextPipeline._prepare_latent_image_ids(batch, h // 2, w // 2, latents.device, dtype)
        image_ids = ids.clone()
        image_ids[..., 0] = 1
        prompt_embeds = emb["prompt_embeds"].to(dtype)
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=latents.device, dtype=dtype)
        guidance = None
        if config.guidance_embeds:
            guidance = torch.full((batch,), float(self.cfg.guidance_scale), device=latents.device)
        scale = self.pipe.scheduler.config.num_train_timesteps
        out = transformer(
            hidden_states=torch.cat([latents.to(dtype), emb["image_latents"].to(dtype)], dim=1),
            timestep=(sigma.float() * scale).to(dtype) / scale,
            guidance=guidance,
            pooled_projections=emb["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=torch.cat([ids, image_ids], dim=0),
            return_dict=False,
        )[0]
        return out[:, :tokens]
