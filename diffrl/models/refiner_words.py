"""The word-level tokenizer of the ShapeWorld refiner LM and of the refiner's tiny twin.

Its vocabulary is every word of the ShapeWorld grammar and of its paraphrase grammar
(:mod:`rewards.shapeworld.paraphrase`), PromptRL's instruction words and the answer tags,
so the toy LM can read a paraphrase and write a grammar caption (which the toy flow
model's own, smaller vocabulary reads). It has a chat template, so the ``promptrl``
template (a chat message, the answer between tags) runs on the tiny twin as on Qwen.
"""

from __future__ import annotations

import re

SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>", "<sep>", "<answer>", "</answer>", "<|user|>", "<|assistant|>")
# the chat template the ``promptrl`` refiner template applies (a real LM brings its own)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vocabulary() -> tuple[str, ...]:
    """Every word the refiner's tokenizer knows, in a fixed order."""
    from diffrl.models.refiner_template import PROMPTRL_INSTRUCTION
    from rewards.shapeworld import grammar
    from rewards.shapeworld import paraphrase as para

    words: list[str] = []
    sources = [
        " ".join(grammar.COLOURS + grammar.SHAPES + tuple(grammar.NUMBERS) + grammar.RELATIONS),
        "circles squares triangles and",
        " ".join(w for synonyms in para.COLOUR_SYNONYMS.values() for w in synonyms),
        " ".join(w for synonyms in para.SHAPE_SYNONYMS.values() for w in synonyms),
        "discs dots boxes blocks wedges pyramids",
        " ".join(w for synonyms in para.COUNT_SYNONYMS.values() for w in synonyms),
        " ".join(w for synonyms in para.RELATION_SYNONYMS.values() for w in synonyms),
        # the paraphrase templates' own words
        "just of them ones which is are that sits next also there simple picture showing on plain white "
        "background an image in we see placed together with please draw i want thanks could you render "
        "plus side , : ?",
        PROMPTRL_INSTRUCTION,
    ]
    for text in sources:
        for word in re.findall(r"\w+|[^\w\s]", text.lower()):
            if word not in words:
                words.append(word)
    return tuple(words)


def refiner_tokenizer():
    """A ``PreTrainedTokenizerFast`` over :func:`vocabulary`: lowercased, split on spaces and
    punctuation, specials matched whole, unknown words ``<unk>``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        sep_token="<sep>",
        additional_special_tokens=list(SPECIALS[5:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
