"""Input normalisation shared by rewards: tensors or PIL images -> float (B, 3, H, W)."""

from __future__ import annotations

import numpy as np
import torch

from rewards.errors import UserError


class RewardInputError(UserError, ValueError):
    """Images passed to a reward have the wrong type, shape or range."""


def to_tensor_batch(images) -> torch.Tensor:
    """Float [0, 1] tensor (B, 3, H, W), or (B, F, 3, H, W) for video, from tensors or PIL."""
    if isinstance(images, (list, tuple)):
        if not images:
            raise RewardInputError("reward got an empty image list")
        arrays = []
        for i, im in enumerate(images):
            if not hasattr(im, "convert"):
                raise RewardInputError(
                    f"image {i} is {type(im).__name__}; expected a PIL image or a tensor batch"
                )
            arrays.append(
                torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)
            )
        sizes = sorted({tuple(a.shape[1:]) for a in arrays})
        if len(sizes) > 1:
            raise RewardInputError(
                f"PIL images in one batch must share a size; got {sizes} (resize them first)"
            )
        return torch.stack(arrays)
    if not isinstance(images, torch.Tensor):
        raise RewardInputError(
            f"reward got {type(images).__name__}; expected a float tensor or a list of PIL images"
        )
    if images.ndim not in (4, 5) or images.shape[-3] != 3:
        raise RewardInputError(
            "reward images must be (B, 3, H, W) or (B, F, 3, H, W) with 3 channels; got shape "
            f"{tuple(images.shape)}"
        )
    return images.float()


def to_uint8_hwc(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) float [0, 1] -> (B, H, W, 3) uint8 (rounded, clamped)."""
    return (images.detach().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
