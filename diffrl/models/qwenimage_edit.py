"""Qwen-Image-Edit adapter: instruction-based image editing over ``QwenImageEditPipeline``.

Qwen-Image-Edit (Qwen team, "Qwen-Image Technical Report", 2025) is the Qwen-Image 20B
MMDiT (:mod:`diffrl.models.qwenimage`) trained to edit. The input image enters twice
(diffusers ``pipeline_qwenimage_edit.py``):

* *semantically*, through Qwen2.5-VL: the instruction is wrapped in a chat template whose
  user turn holds the image (``<|vision_start|><|image_pad|><|vision_end|>``; the
  ``Qwen2VLProcessor`` expands the pad token into one token per 2x2 merged group of 14 px
  patches, and the vision tower's features replace them). The system prefix of 64 tokens
  (``prompt_template_encode_start_idx``) is dropped, so the conditioning starts at
  ``<|vision_start|>``: vision tokens, then the instruction, then the template's 5 closing
  tokens;
* *in appearance*, through the VAE: its latents, normalised and packed 2x2 as the target's,
  are appended to the image tokens, ``img_shapes`` lists both the target's and the image's
  grid (so the RoPE frame index tells them apart), and only the target tokens' output is
  kept (``noise_pred[:, :latents.size(1)]``).

Guidance is Qwen-Image's true CFG with the per-token norm rescale; the negative prompt
``" "`` is encoded *with the same image* (the pipeline passes the image to both
``encode_prompt`` calls, and the same image latents to both transformer calls), so the
negative embeddings are per image and cached with the prompt. Schedule, decode, LoRA
targets and the layers kept in high precision are Qwen-Image's.

Each prompt is an :class:`~rewards.prompts.EditPrompt`: the instruction plus its input
image. Everything image-dependent (the VL embeddings, positive and negative, and the
image latents) is the prompt's conditioning, cached with it: each input image is encoded
once.

Deliberate deviations:

* the input image is resized to the run's ``height`` x ``width`` (Lanczos, as diffusers'
  image processor) for both the VAE and the VL encoder, where the pipeline resizes it to
  about 1024^2 pixels at its aspect ratio (``calculate_dimensions(1024 * 1024, ratio)``,
  with no argument to turn it off) whatever the output size: RL generates at one fixed
  size, and equal input and output sizes keep one token layout per run (as FLUX.1 Kontext
  here). At 512 px the VL encoder so sees 18 x 18 = 324 vision tokens instead of 37 x 37
  = 1369, and the transformer 1024 appended image tokens instead of 4096;
* the embeddings are zero-padded (mask 0) to a fixed length, the vision span of an image
  at the run size plus ``max_sequence_length`` text tokens (the instruction and the 5
  closing tokens), and longer instructions are cut there, as ``QwenImagePipeline`` cuts
  text-to-image prompts; the edit pipeline pads to the longest prompt of its batch and
  never cuts. Masked tokens take no part in attention, so the velocity is the pipeline's;
* the one-step schedule and the fp32 CFG combination are Qwen-Image's (see
  :mod:`diffrl.models.qwenimage`).

``random:qwen-image-edit`` on the meta device: the VL encoding reads token and image
values (rope indices, vision windows), which meta tensors lack, so ``_encode_text``, which
here is the whole VL part, instruction *and* image, runs on the CPU with the twin's
encoder widened to the published text width; the image latents go through the full-size
VAE on meta, which gives the real image-token count (:func:`diffrl.models.arch.build_random_adapter`).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

from diffrl.data.prompts import PromptFileError
from diffrl.models import tiny
from diffrl.models.base import Conditioning
from diffrl.models.loading import finalize_pipeline, module_dtype
from diffrl.models.qwenimage import QwenImageAdapter, _pad_to, tiny_text_encoder_config
from rewards.prompts import EditPrompt, load_image

# Words and pre-tokenizer pieces of QwenImageEditPipeline's system prompt beyond the
# tiny Qwen2 tokenizer's own: with each a single token, as in the real vocabulary, the
# prefix before <|vision_start|> is exactly the 64 tokens the pipeline drops.
EDIT_TEMPLATE_WORDS = tuple(
    """features input key then explain how instruction should alter or modify Generate new that
    meets requirements while maintaining consistency original where appropriate ( ), 's""".split()
)
# Editing instructions' common verbs and the ShapeWorld editing task's words, so that the
# tiny twin's instructions fit its 16-token text budget.
EDIT_WORDS = tuple("make remove turn into change add replace circle square triangle cyan".split())
# processor/preprocessor_config.json of Qwen-Image-Edit (Qwen2.5-VL's): 14 px patches,
# 2 frames per temporal patch, 2x2 merge, between 56^2 and 3584^2 pixels. The tiny vision
# tower keeps these (Qwen2_5_VLVisionConfig's defaults), so vision-token counts are the
# real ones at every size: 4 for the twin's 32 px images (upscaled to 56 px), 324 at 512 px.
QWEN_VL_IMAGE_PROCESSOR = dict(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384},
)


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit: Qwen-Image plus the input image through Qwen2.5-VL and as appended tokens."""

    family = "qwenimage_edit"
    pipeline_class = QwenImageEditPipeline
    edits_images = True
    # the negative branch reads the same image latents (stored as negative_image_latents)
    cond_keys = ("prompt_embeds", "prompt_embeds_mask", "image_latents")

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, model_cfg) -> QwenImageEditAdapter:
        """The tiny Qwen-Image twin's transformer, VAE and scheduler (same seed, same weights)
        with a ``Qwen2VLProcessor`` built in memory: Qwen2.5-VL's image processor settings and
        the tiny Qwen2 tokenizer with the edit template's words, and a text encoder of the
        same tiny config whose vision-token ids are that tokenizer's."""
        from transformers import (
            Qwen2_5_VLForConditionalGeneration,
            Qwen2VLImageProcessor,
            Qwen2VLProcessor,
            Qwen2VLVideoProcessor,
        )

        base = QwenImageAdapter.build_tiny(model_cfg).pipe
        tok = tiny.qwen2_tokenizer(extra_words=EDIT_TEMPLATE_WORDS + EDIT_WORDS)
        with tiny.seeded(model_cfg.tiny_seed):
            text_encoder = Qwen2_5_VLForConditionalGeneration(tiny_text_encoder_config(tok))
        processor = Qwen2VLProcessor(
            image_processor=Qwen2VLImageProcessor(**QWEN_VL_IMAGE_PROCESSOR),
            tokenizer=tok,
            video_processor=Qwen2VLVideoProcessor(),  # required by the class, never used
        )
        pipe = QwenImageEditPipeline(
            scheduler=base.scheduler,
            vae=base.vae,
            text_encoder=text_encoder,
            tokenizer=tok,
            processor=processor,
            transformer=base.transformer,
        )
        return cls(finalize_pipeline(pipe, model_cfg), model_cfg)

    # -- prompts ------------------------------------------------------------------------
    def _encode_uncached(self, prompts: list[str]) -> Conditioning:
        """The VL conditioning of each instruction with its image (and of ``" "`` with the
        same image), plus the image's packed latents, encoded as the pipeline does: [-1, 1],
        the VAE posterior's mode, ``(x - mean) / std``, packed 2x2."""
        missing = [p for p in prompts if not isinstance(p, EditPrompt)]
        if missing:
            raise PromptFileError(
                f"qwenimage_edit edits images, but prompt {str(missing[0])!r} has no input image; "
                "give the prompt file an 'image' column (.jsonl)"
            )
        cond = self._encode_text(prompts)
        latents = self._image_latents([p.image for p in prompts])
        cond.tensors["image_latents"] = latents
        if "negative_prompt_embeds" in cond.tensors:
            cond.tensors["negative_image_latents"] = latents
        return cond

    def _encode_text(self, prompts: list[EditPrompt]) -> Conditioning:
        """The pipeline's ``encode_prompt`` of each instruction *with its image* (Qwen2.5-VL sees
        both; the 64-token system prefix dropped), and with CFG of ``" "`` with the same
        image, padded to :meth:`text_length`. This is all of the text encoder's work, the
        part a ``random:`` build on the meta device runs on its CPU encoder."""
        images = [self._vl_image(p.image) for p in prompts]
        embeds, mask = self._encode_with_images([str(p) for p in prompts], images)
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if self.do_cfg:
            neg, neg_mask = self._encode_with_images([self.negative_prompt] * len(prompts), images)
            out["negative_prompt_embeds"] = neg
            out["negative_prompt_embeds_mask"] = neg_mask
        return Conditioning(out)

    def _encode_with_images(self, texts: list[str], images) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.text_length()
        embeds, mask = self.pipe.encode_prompt(texts, image=images)
        embeds = embeds[:, :length]
        mask = None if mask is None else mask[:, :length]
        return _pad_to(embeds, mask, length)

    def vision_tokens(self) -> int:
        """Vision tokens of an input image at the run size: its 14 px patches after the
        processor's resize, over the 2x2 merge."""
        processor = self.pipe.processor.image_processor
        patches = processor.get_number_of_image_patches(self.cfg.height, self.cfg.width, {})
        return patches // processor.merge_size**2

    def text_length(self) -> int:
        """Length of the cached embeddings: ``<|vision_start|>``, the vision tokens,
        ``<|vision_end|>``, then ``max_sequence_length`` tokens for the instruction and the
        template's closing tokens."""
        return self.vision_tokens() + 2 + self.cfg.max_sequence_length

    def _vl_image(self, path: str):
        """The input image at the run size as the PIL image the pipeline hands its processor."""
        from PIL import Image

        pixels = load_image(path, (self.cfg.height, self.cfg.width), "lanczos")
        array = (pixels.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)  # exact: uint8 / 255
        return Image.fromarray(array)

    def _image_latents(self, paths: list[str]) -> torch.Tensor:
        vae = self.pipe.vae
        pixels = torch.stack([load_image(p, (self.cfg.height, self.cfg.width), "lanczos") for p in paths])
        pixels = (2 * pixels - 1).unsqueeze(2).to(device=vae.device, dtype=vae.dtype)  # one frame
        latents = retrieve_latents(vae.encode(pixels), sample_mode="argmax")
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = (latents - mean) / std
        batch, channels, _, h, w = latents.shape
        return QwenImageEditPipeline._pack_latents(latents, batch, channels, h, w)

    # -- model --------------------------------------------------------------------------
    def _forward(self, transformer, latents, sigma, emb):
        """The target tokens, then the input image's; ``img_shapes`` lists both grids (equal:
        the input is at the run size); the target tokens' output is the velocity."""
        dtype = module_dtype(transformer)
        batch, tokens = latents.shape[:2]
        h, w = self._latent_hw()
        scale = self.pipe.scheduler.config.num_train_timesteps
        out = transformer(
            hidden_states=torch.cat([latents.to(dtype), emb["image_latents"].to(dtype)], dim=1),
            timestep=(sigma.float() * scale).to(dtype) / scale,
            guidance=None,
            encoder_hidden_states=emb["prompt_embeds"].to(dtype),
            encoder_hidden_states_mask=emb["prompt_embeds_mask"],
            img_shapes=[[(1, h // 2, w // 2), (1, h // 2, w // 2)]] * batch,
            return_dict=False,
        )[0]
        return out[:, :tokens]
