"""LAION aesthetic predictor v2 ("improved aesthetic predictor", C. Schuhmann,
github.com/christophschuhmann/improved-aesthetic-predictor), as used by DDPO (Black et al.
2023) for its aesthetic-quality reward.

The score is a linear MLP head on the L2-normalised CLIP ViT-L/14 image embedding
(``simple_inference.py``: ``normalized(model2.encode_image(image))`` then ``MLP(768)``).
Head checkpoint ``sac+logos+ava1-l14-linearMSE.pth``: a plain state dict of that MLP's
``nn.Sequential`` ``layers`` -- keys ``layers.{0,2,4,6,7}.{weight,bias}`` (indices 1, 3, 5
are Dropout) -- saved from CUDA, hence ``map_location="cpu"`` when loading. The CLIP image
tower is transformers' ``CLIPVisionModelWithProjection`` (``openai/clip-vit-large-patch14``,
as ddpo-pytorch's ``AestheticScorer``), preprocessed as ``CLIPImageProcessor``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from rewards.clip_common import (
    ClipReward,
    hf_pretrained,
    hub_file,
    image_size_of,
    local_file,
    normalize,
    resize_shortest_and_center_crop,
    url_file,
)
from rewards.heads import RewardMLP

HEAD_URL = (
    "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
    "sac+logos+ava1-l14-linearMSE.pth"
)


# the official head: linear, no activations (the released model was trained with MSE)
AestheticMLP = RewardMLP


def resolve_head(reward: str, head: str) -> str:
    """A local file, an ``https://`` URL (torch.hub cache) or ``hf://owner/repo/file`` (hub cache)."""
    if head.startswith(("http://", "https://")):
        return url_file(reward, head)
    if head.startswith("hf://"):
        repo_id, _, filename = head[len("hf://") :].rpartition("/")
        return hub_file(reward, repo_id, filename, arg="head")
    return local_file(reward, head, f"Fetch it with `wget '{HEAD_URL}' -O '{head}'`.")


def load_head(path: str, input_size: int) -> AestheticMLP:
    head = AestheticMLP(input_size)
    # the released file stores CUDA tensors: load onto the CPU, the reward moves it later
    state = torch.load(path, map_location="cpu", weights_only=True)
    head.load_state_dict(state, strict=True)
    return head


class LaionAesthetic(ClipReward):
    """``reward(images, prompts=None) -> {"aesthetic": predicted 1-10 rating (B,)}``.

    Args:
        pretrained: hub id or local directory of the CLIP ViT-L/14 (a full ``CLIPModel``
            checkpoint works: only the vision tower and projection are loaded).
        head: the MLP weights: local path, https URL or ``hf://owner/repo/filename``
            (default: the official file on GitHub, cached under torch.hub's directory).
        device, dtype, batch_size: where and how to run; ``batch_size`` images per forward.
    """

    name = "aesthetic"
    needs_prompts = False

    def __init__(
        self,
        pretrained: str = "openai/clip-vit-large-patch14",
        head: str = HEAD_URL,
        device=None,
        dtype="float32",
        batch_size: int = 16,
    ):
        from transformers import CLIPVisionModelWithProjection

        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.clip = hf_pretrained(
            self.name, CLIPVisionModelWithProjection, pretrained, output_loading_info=True
        )
        self.head = load_head(resolve_head(self.name, os.fspath(head)), self.clip.config.projection_dim)
        self.image_size = image_size_of(self.clip.config.image_size)
        self._freeze()

    def _modules(self):
        return [self.clip, self.head]

    def preprocess(self, pixels: torch.Tensor) -> torch.Tensor:
        return normalize(resize_shortest_and_center_crop(pixels, self.image_size))

    def embeddings(self, pixels: torch.Tensor) -> torch.Tensor:
        """L2-normalised CLIP image embeddings (B, D) in fp32."""
        embeds = self.clip(pixel_values=self.preprocess(pixels).to(self.dtype)).image_embeds
        return F.normalize(embeds.float(), dim=-1)

    def _score(self, pixels, prompts):
        embeds = self.embeddings(pixels)
        return {self.name: self.head(embeds.to(self.dtype)).squeeze(-1)}
