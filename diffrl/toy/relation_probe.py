"""Does a toy model read the relation word? (issue 15's diagnosis of the 0.45 plateau)

Two measurements on the same relation prompts, each asked with all four relation words:

* **placement**: of samples where both objects are found once, the share in which the
  second object lies right of (below) the first. A model that reads the word puts the
  second object on the right far more often for "to the left of" than for "to the right
  of"; one that ignores it gives the same shares for every word.
* **sensitivity**: the mean absolute change of the transformer's output when only the
  relation word changes ("left" vs "right"), next to the change when only the first
  object's colour changes, on the same noisy input.
"""

from __future__ import annotations

import random

import torch

from rewards.shapeworld import detect, grammar

RELATIONS = ("to the left of", "to the right of", "above", "below")


def with_relation(prompt: str, relation: str) -> str:
    spec = grammar.parse(prompt)
    return grammar.Spec("relation", spec.groups, relation).caption()


def placement(prompts: list[str], images: torch.Tensor, margin: float = 2.0) -> dict:
    """Share of images (B, 3, H, W in [0, 1]) whose second object is right of / below the
    first by more than ``margin`` pixels, over those where each object is found exactly once."""
    right, below = [], []
    for prompt, found in zip(prompts, detect(images.float())):
        a, b = grammar.parse(prompt).groups
        da = [d for d in found if (d.colour, d.shape) == a.thing]
        db = [d for d in found if (d.colour, d.shape) == b.thing]
        if len(da) == 1 and len(db) == 1:
            right.append(db[0].cx - da[0].cx > margin)
            below.append(db[0].cy - da[0].cy > margin)
    n = len(right)
    return {"n": n, "b_right_of_a": sum(right) / max(n, 1), "b_below_a": sum(below) / max(n, 1)}


def relation_prompts(which: str, n: int, seed: int = 0) -> list[str]:
    train, heldout = grammar.split()
    pool = [p for p in (train if which == "train" else heldout) if grammar.parse(p).kind == "relation"]
    return random.Random(seed).sample(pool, min(n, len(pool)))


@torch.no_grad()
def sample_placement(pipe, prompts: list[str], steps: int = 20, seed: int = 0) -> dict[str, dict]:
    """:func:`placement` of ODE samples for every relation word (the same noise for each)."""
    out = {}
    for relation in RELATIONS:
        asked = [with_relation(p, relation) for p in prompts]
        images = pipe(
            asked, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type="pt"
        )
        out[relation] = placement(asked, images)
    return out


@torch.no_grad()
def sensitivity(pipe, prompts: list[str], sigma: float = 0.8, seed: int = 0) -> dict[str, float]:
    """Mean |change| of the transformer output when only the relation word, or only the
    first object's colour, changes."""
    left = [with_relation(p, "to the left of") for p in prompts]
    right = [with_relation(p, "to the right of") for p in prompts]
    recoloured = [_recolour_first(p) for p in left]
    size = pipe.transformer.config.sample_size
    x = torch.randn((len(prompts), 3, size, size), generator=torch.Generator().manual_seed(seed))
    s = torch.full((len(prompts),), sigma)

    def output(captions):
        embeds, pooled = pipe.text_embeddings(captions)
        return pipe.velocity(x, s, embeds, pooled)

    base = output(left)
    return {
        "relation_word": float((output(right) - base).abs().mean()),
        "first_colour": float((output(recoloured) - base).abs().mean()),
    }


def _recolour_first(prompt: str) -> str:
    spec = grammar.parse(prompt)
    first, second = spec.groups
    colour = next(c for c in grammar.COLOURS if c != first.colour and (c, first.shape) != second.thing)
    return grammar.Spec(
        spec.kind, (grammar.Group(first.count, colour, first.shape), second), spec.relation
    ).caption()
