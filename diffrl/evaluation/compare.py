"""Side-by-side alignment comparisons (``scripts/compare.py``).

Rows are prompt x seed, columns are checkpoints (and RLG scales). Every column samples a
row from the same initial noise, the evaluation key ("eval", prompt index, seed) with
the deterministic ODE sampler, through the one generate-and-score loop an evaluation
uses (:mod:`diffrl.inference.generate`: the run's autocast and evaluation guidance), so
two identical checkpoints give identical pixels, any difference between columns is the
weights', and a column's tiles are the images the run's evaluation scored. Each tile is
scored with the chosen rewards, and the change against the ``base`` column is kept. A
checkpoint column loads the weights its evaluations scored (the EMA where the run kept
one; :func:`diffrl.inference.weights.load_weights`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrl.evaluation.rlg import GuidedTransformer
from diffrl.inference.generate import GenerationSettings, generate_and_score, plan_samples
from diffrl.inference.weights import holds_weights, load_weights
from rewards.errors import UserError


class CompareError(UserError, ValueError):
    """A bad checkpoint, prompt list or scale: one line naming it and the fix."""


@dataclass
class Column:
    name: str
    path: Path | None  # None: the base model
    scale: float | None = None  # RLG scale, or None for the checkpoint as trained


@dataclass
class Tile:
    prompt: str
    prompt_index: int
    seed: int
    column: str
    image: torch.Tensor  # (3, H, W) or (F, 3, H, W) in [0, 1]
    scores: dict[str, float] = field(default_factory=dict)
    delta: dict[str, float] = field(default_factory=dict)


def parse_checkpoints(specs: list[str]) -> list[Column]:
    """``base``, ``PATH`` or ``NAME=PATH``; a checkpoint directory holds
    ``trainable.safetensors`` (a diffrl checkpoint), ``pytorch_lora_weights.safetensors``
    (a diffusers LoRA) or ``transformer/`` (a full fine-tune, with a full_finetune config)."""
    cols = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = (spec, "") if spec == "base" else (Path(spec).name, spec)
        if name == "base" and not path:
            cols.append(Column("base", None))
            continue
        if not holds_weights(Path(path)):
            raise CompareError(
                f"checkpoint '{spec}': no trainable.safetensors, pytorch_lora_weights.safetensors or "
                f"transformer/ in '{path}'; pass a run's checkpoints/step-N directory, a diffusers LoRA "
                "directory or a full fine-tune's directory"
            )
        cols.append(Column(name, Path(path)))
    if len({c.name for c in cols}) != len(cols):
        raise CompareError(f"checkpoint names must be unique, got {[c.name for c in cols]}; use NAME=PATH")
    return cols


def with_rlg_scales(columns: list[Column], scales: list[float]) -> list[Column]:
    """Each trained checkpoint once per RLG scale (``name@w``); base stays as it is."""
    out = []
    for c in columns:
        if c.path is None or not scales:
            out.append(c)
        else:
            out += [Column(f"{c.name}@{w:g}", c.path, w) for w in scales]
    return out


def column_model(policy, column: Column):
    """The module that samples a column (weights must already be loaded)."""
    if column.path is None:
        return None  # the caller samples base with adapters disabled
    if column.scale is None:
        return policy.transformer
    # LoRA: adapters on / off on one model; full fine-tune: the frozen base copy
    return GuidedTransformer(
        policy.transformer, column.scale, base=None if policy.is_lora else policy.frozen_reference
    )


def run_comparison(
    session, columns: list[Column], prompts: list[str], seeds: list[int], steps: int
) -> list[Tile]:
    """Sample and score every tile with ``session`` (its adapter, policy and rewards);
    columns sharing a checkpoint load it once."""
    policy = session.policy
    settings = dataclasses.replace(GenerationSettings.of(session.cfg), num_steps=steps)
    samples = plan_samples(prompts, seeds, "eval")  # the keys evaluation uses
    tiles: list[Tile] = []
    loaded = None
    for column in columns:
        if column.path is None:
            with policy.reference() as base:
                scored = _generate(session, base, samples, settings)
        else:
            if loaded != column.path:
                load_weights(policy, column.path, "evaluated", session.cfg.model)
                loaded = column.path
            scored = _generate(session, column_model(policy, column), samples, settings)
        for x in scored:
            # a NaN score does not apply to that image (e.g. a per-kind breakdown): left out
            scores = {k: v for k, v in x.scores.items() if not math.isnan(v)}
            tiles.append(Tile(x.sample.prompt, x.sample.index, x.sample.seed, column.name, x.image, scores))
    _add_deltas(tiles)
    return tiles


def _generate(session, model, samples, settings):
    return generate_and_score(session, samples, settings, model=model, keep_image=lambda position: True)


def _add_deltas(tiles: list[Tile]) -> None:
    base = {(t.prompt_index, t.seed): t.scores for t in tiles if t.column == "base"}
    for t in tiles:
        ref = base.get((t.prompt_index, t.seed))
        if ref is not None:
            t.delta = {k: v - ref[k] for k, v in t.scores.items() if k in ref}
