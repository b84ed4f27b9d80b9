"""Does a toy model read the relation word? (issue 15's diagnosis of the 0.45 plateau)

Two measurements on the same relation prompts, each asked with all four relation words:

* **placement**: of samples where both objects are found once, the share in which the
  second object lies right of (below) the first. A model that reads the word puts the
  second object on the right far more often for "to the left of" than for "to the right
  of"; one that ignores it gives the same shares for every word.
* **positions**: for single-object position captions ("a red circle to the left", the
  pretraining curriculum's first kind, :mod:`diffrl.toy.positions`), the share of samples
  whose one object lies in the left (top) half, per position word.
* **position mass**: the same question asked of the model's x0 prediction from almost
  pure noise (sigma 0.98), where the word is the only thing that says where the object
  goes: the share of predicted object mass in the named half. 0.5 means the word is
  ignored; it needs no drawn objects, so it also reads a model early in pretraining.
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
def position_placement(pipe, steps: int = 20, seed: int = 0) -> dict[str, dict]:
    """Per position word: of samples of every position caption where the object is found
    exactly once, the share whose centre lies in the left half and in the top half."""
    from diffrl.toy import positions

    captions = positions.captions(exclude_heldout_counts=False)
    images = pipe(
        captions, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type="pt"
    )
    half = images.shape[-1] / 2
    found = {p: [] for p in positions.POSITIONS}
    for caption, dets in zip(captions, detect(images.float())):
        spec = positions.parse(caption)
        mine = [d for d in dets if (d.colour, d.shape) == (spec.colour, spec.shape)]
        if len(mine) == 1:
            found[spec.position].append((mine[0].cx < half, mine[0].cy < half))
    return {
        p: {
            "n": len(rows),
            "left_half": sum(r[0] for r in rows) / max(len(rows), 1),
            "top_half": sum(r[1] for r in rows) / max(len(rows), 1),
        }
        for p, rows in found.items()
    }


@torch.no_grad()
def darkness_from_noise(pipe, captions: list[str], shape: tuple, sigma: float, seed: int) -> torch.Tensor:
    """Darkness (1 - brightness, mean over channels) of the model's x0 prediction for each
    caption from seeded noise of ``shape`` (C, ...) at ``sigma``: its mean image (or clip)
    for the caption. Images and clips alike (``pipe.text_embeddings`` may return a tuple)."""
    x = torch.randn((len(captions), *shape), generator=torch.Generator().manual_seed(seed))
    s = torch.full((len(captions),), sigma)
    cond = pipe.text_embeddings(captions)
    cond = cond if isinstance(cond, tuple) else (cond,)
    x0 = x - sigma * pipe.velocity(x, s, *cond)  # x_t = x0 + sigma v
    return (1 - (x0.clamp(-1, 1) + 1) / 2).mean(1)


@torch.no_grad()
def position_mass(pipe, sigma: float = 0.98, seed: int = 0) -> dict[str, float]:
    """Per position word: the share of the x0 prediction's darkness (1 - brightness, mean
    over channels, from noise at ``sigma``) that lies in the named half, over every
    position caption with that word."""
    from diffrl.toy import positions

    captions = positions.captions(exclude_heldout_counts=False)
    size = pipe.transformer.config.sample_size
    dark = darkness_from_noise(pipe, captions, (3, size, size), sigma, seed)  # (B, H, W)
    half = size // 2
    out = {}
    for position in positions.POSITIONS:
        mass = dark[[c.endswith(position) for c in captions]].sum(0)
        named = {"to the left": mass[:, :half], "to the right": mass[:, half:], "above": mass[:half]}
        out[position] = float(named.get(position, mass[half:]).sum() / mass.sum())
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
