"""JPEG (in)compressibility rewards (DDPO, Black et al. 2023, Sec. 5.1).

The score is the JPEG file size in kilobytes at quality 95: compressibility rewards
-size, incompressibility +size. Weight-free, so a training loop runs with no download.
Video inputs are scored per frame and averaged.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from rewards.images import to_tensor_batch, to_uint8_hwc


def jpeg_size_kb(images, quality: int = 95) -> torch.Tensor:
    batch = to_tensor_batch(images)
    frames = batch.flatten(0, 1) if batch.ndim == 5 else batch
    sizes = []
    for arr in to_uint8_hwc(frames):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    out = torch.tensor(sizes, dtype=torch.float32)
    return out.view(batch.shape[0], -1).mean(1) if batch.ndim == 5 else out


class JpegCompressibility:
    name = "jpeg_compressibility"
    sign = -1.0

    def __init__(self, quality: int = 95):
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"{self.name}: quality must be in [1, 100], got {quality}")
        self.quality = int(quality)

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        size = jpeg_size_kb(images, self.quality)
        return {self.name: self.sign * size, "jpeg_size_kb": size}


class JpegIncompressibility(JpegCompressibility):
    name = "jpeg_incompressibility"
    sign = 1.0
