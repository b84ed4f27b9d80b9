"""Video rewards on (B, F, 3, H, W) clips in [0, 1].

* ``video_frames``: any registered image reward applied to ``num_frames`` frames sampled
  uniformly over the clip (first and last included), aggregated by ``mean`` or ``min``
  (min asks every sampled frame to be good, the stricter target); ``frames: first`` scores
  the first frame only (PickScore on the first frame beside VideoAlign, as DanceGRPO's
  author suggests against VideoAlign's drift to over-exposure, DanceGRPO issue 41).
* ``temporal_consistency``: the mean cosine similarity of adjacent sampled frames' CLIP
  image embeddings (1 for a still clip; flicker and identity drift lower it).
* :class:`VideoVLMReward`: the extension point for VLM-based video reward models (e.g.
  VideoAlign / VideoScore): subclass it, implement :meth:`score_videos`, and register the
  class with ``rewards.register("my_vlm", "package.module:MyVLMReward")``.
"""

from __future__ import annotations

import torch

import rewards
from rewards.images import RewardInputError, to_tensor_batch

AGGREGATES = ("mean", "min")
FRAME_CHOICES = ("uniform", "first")


def as_video(images, reward: str) -> torch.Tensor:
    batch = to_tensor_batch(images)
    if batch.ndim != 5:
        raise RewardInputError(
            f"{reward} scores videos: expected (B, F, 3, H, W) in [0, 1], got shape "
            f"{tuple(batch.shape)}; for images use the image reward itself"
        )
    return batch


def uniform_frames(num_frames: int, count: int) -> list[int]:
    """``count`` frame indices spread evenly from the first to the last frame."""
    if count >= num_frames:
        return list(range(num_frames))
    if count == 1:
        return [num_frames // 2]
    return [round(i * (num_frames - 1) / (count - 1)) for i in range(count)]


class FrameReward:
    """An image reward over uniformly sampled frames (registry name ``video_frames``)."""

    name = "video_frames"

    def __init__(
        self,
        reward: str = "jpeg_compressibility",
        args: dict | None = None,
        num_frames: int = 4,
        aggregate: str = "mean",
        frames: str = "uniform",
    ):
        if frames not in FRAME_CHOICES:
            raise ValueError(f"{self.name}: frames must be one of {FRAME_CHOICES}, got '{frames}'")
        if aggregate not in AGGREGATES:
            raise ValueError(f"{self.name}: aggregate must be one of {AGGREGATES}, got '{aggregate}'")
        if int(num_frames) < 1:
            raise ValueError(f"{self.name}: num_frames must be >= 1, got {num_frames}")
        self.inner_name, self.num_frames, self.aggregate = reward, int(num_frames), aggregate
        self.frames = frames
        self.inner = rewards.build(reward, **(args or {}))

    def to(self, *args, **kwargs):
        if hasattr(self.inner, "to"):
            self.inner.to(*args, **kwargs)
        return self

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        video = as_video(images, self.name)
        b = video.shape[0]
        idx = [0] if self.frames == "first" else uniform_frames(video.shape[1], self.num_frames)
        frames = video[:, idx].flatten(0, 1)  # (B * n, 3, H, W), clip-major
        texts = None if prompts is None else [p for p in prompts for _ in idx]
        per_frame = self.inner(frames, texts, metadata or {})[self.inner_name].reshape(b, len(idx))
        agg = per_frame.mean(1) if self.aggregate == "mean" else per_frame.min(1).values
        return {
            self.name: agg,
            f"{self.inner_name}_frame_mean": per_frame.mean(1),
            f"{self.inner_name}_frame_min": per_frame.min(1).values,
        }


class TemporalConsistency:
    """Mean cosine similarity of adjacent frames' CLIP image embeddings (registry name
    ``temporal_consistency``); ``pretrained`` is a transformers CLIP model (hub id or a
    local directory)."""

    name = "temporal_consistency"

    def __init__(
        self,
        pretrained: str = "openai/clip-vit-large-patch14",
        num_frames: int = 8,
        device=None,
        dtype="float32",
        batch_size: int = 16,
    ):
        from transformers import CLIPVisionModelWithProjection

        from rewards.clip_common import hf_pretrained, image_size_of, resolve_dtype

        self.model = (
            hf_pretrained(self.name, CLIPVisionModelWithProjection, pretrained).eval().requires_grad_(False)
        )
        self.size = image_size_of(self.model.config.image_size)
        self.num_frames, self.batch_size = int(num_frames), int(batch_size)
        self.to(device or "cpu", resolve_dtype(dtype))

    def to(self, device=None, dtype=None):
        self.model.to(device=device, dtype=dtype)
        self.device, self.dtype = self.model.device, self.model.dtype
        return self

    def embed(self, frames: torch.Tensor) -> torch.Tensor:
        from rewards.clip_common import normalize, resize_shortest_and_center_crop

        out = []
        for s in range(0, frames.shape[0], self.batch_size):
            pixels = normalize(
                resize_shortest_and_center_crop(frames[s : s + self.batch_size].float(), self.size)
            )
            out.append(self.model(pixel_values=pixels.to(self.device, self.dtype)).image_embeds.float())
        return torch.nn.functional.normalize(torch.cat(out), dim=-1)

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        video = as_video(images, self.name)
        b = video.shape[0]
        idx = uniform_frames(video.shape[1], self.num_frames)
        if len(idx) < 2:
            raise RewardInputError(f"{self.name} needs clips of at least 2 frames, got {video.shape[1]}")
        emb = self.embed(video[:, idx].flatten(0, 1)).reshape(b, len(idx), -1)
        cos = (emb[:, 1:] * emb[:, :-1]).sum(-1)  # (B, n - 1) adjacent-pair cosines
        return {self.name: cos.mean(1), f"{self.name}_min": cos.min(1).values}


class VideoVLMReward:
    """Base class for VLM-based video rewards. Subclasses set ``name`` and implement
    :meth:`score_videos`; frame sampling, input checks and the output dict are shared."""

    name = "video_vlm"
    num_frames = 8

    def score_videos(self, clips: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """(B, n, 3, H, W) sampled frames in [0, 1] and B prompts -> {name: (B,), ...}."""
        raise NotImplementedError(f"{type(self).__name__} must implement score_videos(clips, prompts)")

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        video = as_video(images, self.name)
        if prompts is None or len(prompts) != video.shape[0]:
            raise RewardInputError(f"{self.name} needs one prompt per clip ({video.shape[0]})")
        out = self.score_videos(video[:, uniform_frames(video.shape[1], self.num_frames)], list(prompts))
        if self.name not in out:
            raise KeyError(f"{type(self).__name__}.score_videos must return '{self.name}', got {sorted(out)}")
        return out
