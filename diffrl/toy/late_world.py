"""The late-step world's pretraining pieces (issue 38, item 2): its captions, its caption
noise (a wrong texture only), its evaluation prompts, and a text encoder that reads the
texture words.

The world (``rewards.shapeworld.grammar.late_split``) asks for striped or solid objects. Its
base is pretrained from the capable ShapeWorld base, which draws colours and shapes well,
with caption noise on the textures alone: the base then draws shapes right and textures
loosely, so an RL group's reward differs mostly by texture, which only the last
denoising steps settle (``scripts/probe_decision_depth.py`` measures it).
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from rewards.shapeworld import grammar

TEXTURE_WORDS = grammar.TEXTURES  # appended to the toy vocabulary, after the image words
KIND_WEIGHTS = "1,3,0,0"  # single objects, pairs, no relations, no position captions


def captions_by_kind() -> list[list[str]]:
    """The late world's training captions by pretraining kind (count = one object, pair,
    relation, position): the last two are empty."""
    train, _ = grammar.late_split()
    return [[p for p in train if grammar.parse(p).kind == k] for k in ("count", "pair")] + [[], []]


def eval_sets(n: int) -> dict[str, list[str]]:
    train, heldout = grammar.late_split()
    return {"heldout": heldout[:n], "train": train[:n]}


def flip_texture(spec: grammar.Spec, rnd: random.Random) -> grammar.Spec:
    """``spec`` with one group's texture swapped: the only corruption of the late world's
    noisy captions, so the base learns shapes from every caption and textures loosely."""
    groups = list(spec.groups)
    i = rnd.randrange(len(groups))
    swapped = "solid" if groups[i].texture == "striped" else "striped"
    groups[i] = replace(groups[i], texture=swapped)
    return grammar.Spec(spec.kind, tuple(groups), spec.relation)


def read_texture_words(pipe) -> None:
    """Give ``pipe`` (a toy pipeline) the texture words: a tokenizer with them appended
    (every older word keeps its id) and two new text-embedding rows, initialised like the
    existing ones (normal with their standard deviation), so a model trained on
    ShapeWorld continues into the late world."""
    from diffrl.models.toy import word_tokenizer

    if all(w in pipe.tokenizer.get_vocab() for w in TEXTURE_WORDS):
        return
    old = pipe.tokenizer
    pipe.tokenizer = word_tokenizer(old.model_max_length, extra_words=TEXTURE_WORDS)
    embedding = pipe.text_encoder.get_input_embeddings()
    std = float(embedding.weight.detach().std())
    pipe.text_encoder.resize_token_embeddings(len(pipe.tokenizer.get_vocab()), mean_resizing=False)
    with torch.no_grad():
        new = pipe.text_encoder.get_input_embeddings().weight
        new[embedding.weight.shape[0] :].normal_(0.0, std)
    pipe.register_modules(tokenizer=pipe.tokenizer)
