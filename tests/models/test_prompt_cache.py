"""The adapters' prompt cache: bounded in bytes, least recently used out first, and the
one-by-one encoding that makes an evaluation's embeddings independent of its batches."""

from __future__ import annotations

import torch

from diffrl.config import load_config
from diffrl.models import build_adapter
from diffrl.models.base import _nbytes


def _adapter():
    return build_adapter(load_config("tiny_flux_flowgrpo").model)


def test_the_cache_stays_within_its_bytes_and_drops_the_least_recently_used(monkeypatch):
    adapter = _adapter()
    one = _nbytes(adapter.encode_prompts(["a red cat"]))
    monkeypatch.setattr(adapter, "PROMPT_CACHE_BYTES", 3 * one)
    adapter.encode_prompts(["a dog", "a fox"])
    adapter.encode_prompts(["a red cat"])  # used again: now the most recent
    adapter.encode_prompts(["a cow"])
    assert [prompt for prompt, _ in adapter._prompt_cache] == ["a fox", "a red cat", "a cow"]
    assert adapter._cache_bytes == 3 * one
    again = adapter.encode_prompts(["a dog"])  # evicted, encoded anew: the same embedding
    torch.testing.assert_close(again.tensors, adapter._encode_uncached(["a dog"]).tensors)


def test_one_by_one_gives_each_prompt_its_batch_of_one_embedding():
    adapter = _adapter()
    prompts = ["a red cat", "two dogs on a beach", "a red cat"]
    together = adapter.encode_prompts(prompts, one_by_one=True)
    for i, prompt in enumerate(prompts):
        alone = adapter._encode_uncached([prompt])
        for key, value in together.tensors.items():
            assert torch.equal(value[i : i + 1], alone.tensors[key]), key
