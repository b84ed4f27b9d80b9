"""CLIPScore (Hessel et al. 2021, "CLIPScore: A Reference-free Evaluation Metric for Image
Captioning", arXiv:2104.08718): ``w * max(cos(image, text), 0)``.

The paper uses w = 2.5; we use w = 100 as torchmetrics' ``CLIPScore`` and the T2I-RL
literature report it, so ``clipscore`` reads as "percent cosine". The raw cosine is logged
as ``clipscore_cosine`` (negative values kept), which is the better-behaved quantity to
optimise when prompts and images start unrelated: the clamp at 0 has no gradient there.
"""

from __future__ import annotations

from rewards.clip_common import TransformersClipReward, cosine


class CLIPScore(TransformersClipReward):
    """``reward(images, prompts) -> {"clipscore": scale * max(cos, 0), "clipscore_cosine": cos}``.

    Args:
        pretrained: hub id or local ``save_pretrained`` directory of any transformers
            ``CLIPModel`` (default ``openai/clip-vit-large-patch14``).
        tokenizer: hub id or directory; None uses ``pretrained``.
        scale: the weight w (100 as torchmetrics; the paper's 2.5 also works).
        device, dtype, batch_size: where and how to run; ``batch_size`` images per forward.
    """

    name = "clipscore"
    default_pretrained = "openai/clip-vit-large-patch14"

    def __init__(
        self,
        pretrained: str | None = None,
        tokenizer: str | None = None,
        scale: float = 100.0,
        device=None,
        dtype="float32",
        batch_size: int = 16,
    ):
        super().__init__(
            pretrained=pretrained, tokenizer=tokenizer, device=device, dtype=dtype, batch_size=batch_size
        )
        self.scale = float(scale)

    def _score(self, pixels, prompts):
        image, text = self.features(pixels, prompts)
        cos = cosine(image, text)
        return {self.name: self.scale * cos.clamp(min=0), "clipscore_cosine": cos}
