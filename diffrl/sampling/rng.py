"""Reconstructible randomness.

Every random draw in a rollout comes from its own ``torch.Generator`` whose seed is a
hash of a key tuple such as ``(seed, step, prompt_index, sample_index, "sde", t)``. A
draw can therefore be regenerated in isolation (BF16 replay in Sol-RL, resume, tree
path replay) without replaying the global RNG stream, and results do not depend on
batch composition or on how samples are split across processes.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*key) -> int:
    """A 63-bit seed from a tuple of ints/strings (stable across runs and platforms)."""
    digest = hashlib.blake2b(repr(tuple(key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator(*key) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(*key))
    return gen


def randn(shape, *key) -> torch.Tensor:
    """Standard normal fp32 noise on CPU for ``key`` (move it to the device afterwards, so
    the values are identical on every device)."""
    return torch.randn(tuple(shape), generator=generator(*key), dtype=torch.float32)


def randn_batch(shape, keys, *suffix) -> torch.Tensor:
    """Stack one independent draw per sample key: ``randn(shape, *key, *suffix)`` for each key."""
    return torch.stack([randn(shape, *k, *suffix) for k in keys])


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (host noise) on ``device`` without stalling the host: on CUDA it is staged in
    pinned memory and copied asynchronously (a copy from pageable memory blocks until
    the queued kernels finish, once per denoising step). Elsewhere a plain ``.to``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
