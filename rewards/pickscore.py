"""PickScore (Kirstain et al. 2023, "Pick-a-Pic: An Open Dataset of User Preferences for
Text-to-Image Generation", arXiv:2305.01569).

A CLIP ViT-H-14 (transformers ``CLIPModel``, hub ``yuvalkirstain/PickScore_v1``) fine-tuned
on Pick-a-Pic; its tokenizer/processor is the base model's
(``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``). The official usage (PickScore README) is
``model.logit_scale.exp() * (text_embs @ image_embs.T)`` on L2-normalised embeddings, i.e.
``logit_scale.exp() * cosine`` per image/prompt pair (about 20-23 for typical images).
"""

from __future__ import annotations

from rewards.clip_common import TransformersClipReward, cosine


class PickScore(TransformersClipReward):
    """``reward(images, prompts) -> {"pickscore": exp(logit_scale) * cos, "pickscore_cosine": cos}``.

    Args:
        pretrained: hub id or local ``save_pretrained`` directory of the CLIPModel.
        tokenizer: hub id or directory of the tokenizer; None uses ``pretrained`` when it is
            a directory with tokenizer files, else ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``.
        device, dtype, batch_size: where and how to run; ``batch_size`` images per forward.
    """

    name = "pickscore"
    default_pretrained = "yuvalkirstain/PickScore_v1"
    default_tokenizer = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"

    def _score(self, pixels, prompts):
        image, text = self.features(pixels, prompts)
        cos = cosine(image, text)
        return {self.name: self.model.logit_scale.float().exp() * cos, "pickscore_cosine": cos}
