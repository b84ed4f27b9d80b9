"""``random_control``: a reward that carries no information, for the control run of a
learning experiment.

A learning claim needs a baseline run in the same conditions (the same sampler, update,
LoRA, EMA and evaluation) that differs only in the reward's information. With this reward
the group-normalised advantages are noise, so whatever that run's evaluation does (drift
from the SDE's noise injection, the optimizer, the EMA) is what the update does without a
signal, and the gain of the real run over it is the reward's.

Each sample's score is uniform in [0, 1), a hash of ``seed`` and its pixels quantised to
8 bits: independent of the prompt and of everything the sample shows, and the same for the
same sample (a resumed run or a re-scored batch sees the same number).
"""

from __future__ import annotations

import hashlib

import torch

from rewards.images import to_tensor_batch


def pixel_hash_uniform(sample: torch.Tensor, seed: int) -> float:
    """A number in [0, 1) from blake2b over ``seed`` and the 8-bit pixels of ``sample``."""
    pixels = (sample.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    digest = hashlib.blake2b(pixels.tobytes(), digest_size=8, key=str(int(seed)).encode()).digest()
    return int.from_bytes(digest, "little") / 2.0**64


class RandomControl:
    """Registered as ``random_control``; images (B, 3, H, W) or clips (B, F, 3, H, W)."""

    name = "random_control"

    def __init__(self, seed: int = 0):
        self.seed = int(seed)

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        batch = to_tensor_batch(images)
        scores = [pixel_hash_uniform(sample, self.seed) for sample in batch]
        return {self.name: torch.tensor(scores, dtype=torch.float32)}
