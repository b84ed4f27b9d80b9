"""Tiny offline twins: tokenizers built in memory and seeded random weights.

The tiny twins use the *same* diffusers/transformers classes as the real pipelines so
that every code path (encode_prompt, the transformer call, VAE decode, LoRA loading) is
exercised in CI without a single file being fetched. The tokenizers are real
``tokenizers``-backed classes over a small fixed vocabulary: every byte/character plus
a list of common prompt words, so any lowercase prompt tokenizes deterministically.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

# Words that get a single token; everything else falls back to characters / bytes.
COMMON_WORDS = tuple(
    """a an the of and in on with at to is are by for from under over near photo picture image
    painting drawing sketch render portrait close up view style art digital oil watercolor cat cats
    dog dogs bird horse cow fish car bus bike boat train plane tree trees house city street road forest
    mountain sea beach river lake sky cloud sun moon star night day snow rain flower flowers field
    garden water fire man woman person people child girl boy face hand hands eye eyes hair red green
    blue yellow black white orange purple pink brown gray small large big tiny old young beautiful cute
    sitting standing running flying walking sleeping table chair book cup apple banana bowl clock
    two three four one many background foreground high quality detailed""".split()
)
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()/&"


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for weight init without disturbing the caller's RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _merge_chain(symbols: list[str], vocab: dict[str, int], merges: list[tuple[str, str]], seen: set) -> None:
    """Left-to-right BPE merges that build ``"".join(symbols)`` into one token."""
    current = symbols[0]
    for sym in symbols[1:]:
        if (current, sym) not in seen:
            seen.add((current, sym))
            merges.append((current, sym))
        current += sym
        vocab.setdefault(current, len(vocab))


def clip_tokenizer(model_max_length: int = 77, specials_last: bool = False):
    """CLIPTokenizer: byte-level BPE (every byte, with and without ``</w>``) plus word merges.

    ``specials_last`` puts the start/end tokens after the merges, as the real vocabulary does
    (49406, 49407): OWL-ViT/OWLv2 treat a query whose first id is 0 as padding."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {} if specials_last else {"<|startoftext|>": 0, "<|endoftext|>": 1}
    byte_chars = list(bytes_to_unicode().values())
    for suffix in ("", "</w>"):
        for ch in byte_chars:
            vocab.setdefault(ch + suffix, len(vocab))
    merges: list[tuple[str, str]] = []
    seen: set = set()
    for word in COMMON_WORDS:
        if len(word) > 1:
            _merge_chain(list(word[:-1]) + [word[-1] + "</w>"], vocab, merges, seen)
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab.setdefault(special, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def t5_tokenizer(model_max_length: int = 512):
    """T5 (and UMT5) tokenizer: a sentencepiece-style Unigram over characters and ``▁word`` pieces.

    Whole words score higher than their characters, so known words become one token and
    unknown ones split into characters (anything else maps to ``<unk>``).
    """
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(ch, -8.0) for ch in _CHARS]
    pieces += [("\u2581" + w, -1.0) for w in COMMON_WORDS]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def gemma_tokenizer(model_max_length: int = 8192):
    """GemmaTokenizer: BPE with byte fallback (``<0xNN>``) plus merges for ``▁word`` and ``word``."""
    from transformers import GemmaTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    for ch in "\u2581" + _CHARS:
        vocab.setdefault(ch, len(vocab))
    merges: list[tuple[str, str]] = []
    seen: set = set()
    for word in COMMON_WORDS:
        for piece in ("\u2581" + word, word):
            if len(piece) > 1:
                _merge_chain(list(piece), vocab, merges, seen)
    # Gemma-2's real tokenizer prepends <bos>; it also keeps an all-padding prompt from
    # producing a fully masked attention row.
    return GemmaTokenizerFast(
        vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False, model_max_length=model_max_length
    )


# Words of the Qwen-Image prompt templates that are not in COMMON_WORDS: each must be a
# single token, as in the real Qwen2 vocabulary, so that the template's system prefix is
# exactly the ``prompt_template_encode_start_idx`` tokens the pipeline drops (34 for
# QwenImagePipeline).
QWEN_TEMPLATE_WORDS = tuple(
    """system user assistant Describe detailing color shape size texture quantity text spatial
    relationships objects""".split()
)
# Qwen2.5-VL chat and vision special tokens (the pipelines' templates use the first ones).
QWEN_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


@functools.cache
def _trained_bpe_merges(words: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Byte-pair merges learnt from ``words`` (each counted once) until every word is one symbol.

    Learnt merges, unlike hand-chained ones, cannot be pre-empted by another word's merge
    (``photo`` would otherwise end as ``pho`` + ``to`` once ``to`` has its own merge), so
    every word encodes to a single token. Ties go to the lexicographically first pair:
    deterministic.
    """
    symbols = [list(w) for w in words]
    merges: list[tuple[str, str]] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for word in symbols:
            for pair in zip(word, word[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            return tuple(merges)
        left, right = best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        for word in symbols:
            i = 0
            while i < len(word) - 1:
                if word[i] == left and word[i + 1] == right:
                    word[i : i + 2] = [left + right]
                i += 1


def qwen2_tokenizer(model_max_length: int = 32768, extra_words: tuple[str, ...] = ()):
    """Qwen2Tokenizer (Qwen2.5-VL, the Qwen-Image text encoder's): byte-level BPE over every
    byte, with merges learnt so that each common word and template word is one token, with
    and without a leading space (``Ġword``), plus the chat / vision special tokens.
    ``<|endoftext|>`` (id 0) is the pad token, as in the real tokenizer.

    ``extra_words`` become single tokens too (with and without the leading space): a
    family's template words, or pre-tokenizer pieces such as ``"("`` (giving ``" ("``) or
    ``"'s"``. Without them the vocabulary is exactly the default one."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    space = byte_chars[ord(" ")]  # "Ġ"
    words = sorted(
        {p for w in COMMON_WORDS + QWEN_TEMPLATE_WORDS + tuple(extra_words) for p in (w, space + w)}
    )
    merges = _trained_bpe_merges(tuple(words))
    vocab = {"<|endoftext|>": 0}
    for ch in byte_chars.values():
        vocab.setdefault(ch, len(vocab))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=list(merges),
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS),
        model_max_length=model_max_length,
    )


def clip_text_config(tokenizer, hidden: int = 32, layers: int = 2, projection_dim: int = 32, **kw):
    """CLIPTextConfig sized to ``tokenizer``; eos id set so pooling finds the real eos token."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection_dim,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="quick_gelu",
        **kw,
    )


def t5_config(tokenizer, d_model: int = 32, layers: int = 2, config_class=None):
    """T5Config (or UMT5Config via ``config_class``) for a tiny encoder."""
    if config_class is None:
        from transformers import T5Config as config_class

    return config_class(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=layers,
        num_heads=d_model // 8,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def tiny_autoencoder_kl(
    latent_channels: int = 4, scaling_factor: float = 1.0, shift_factor: float | None = None
):
    """AutoencoderKL with two small blocks (spatial factor 2), no quant convs (as FLUX/SD3)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """VAE output in [-1, 1] to fp32 [0, 1], as the pipelines' image processors do."""
    return (images.float() / 2 + 0.5).clamp(0, 1)
