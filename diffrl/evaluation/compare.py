"""Side-by-side alignment comparisons (``scripts/compare.py``).

Rows are prompt x seed, columns are checkpoints (and RLG scales). Every column samples a
row from the same initial noise, the evaluation key ("eval", prompt index, seed) with
the deterministic ODE sampler, so two identical checkpoints give identical pixels and
any difference between columns is the weights'. Each tile is scored with the chosen
rewards, and the change against the ``base`` column is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrl.evaluation.rlg import GuidedTransformer
from diffrl.evaluation.scoring import eval_plan
from diffrl.sampling.rollout import rollout_independent
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
        p = Path(path)
        if not any(
            (p / f).exists()
            for f in ("trainable.safetensors", "pytorch_lora_weights.safetensors", "transformer")
        ):
            raise CompareError(
                f"checkpoint '{spec}': no trainable.safetensors, pytorch_lora_weights.safetensors or "
                f"transformer/ in '{p}'; pass a run's checkpoints/step-N directory, a diffusers LoRA "
                "directory or a full fine-tune's directory"
            )
        cols.append(Column(name, p))
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


def _lora_file(path: Path) -> dict:
    return {k.removeprefix("transformer."): v for k, v in _read_weights(path).items()}


def _prefixed(state: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in state.items()}


def load_weights(policy, path: Path) -> None:
    """Load a checkpoint's LoRA into the policy (exact fp32 tensors when available)."""

    if (
        not policy.is_lora
        and (path / "transformer").is_dir()
        and not (path / "trainable.safetensors").is_file()
    ):
        full = type(policy.transformer).from_pretrained(str(path / "transformer"))
        policy.transformer.load_state_dict(full.state_dict())
        return
    if (path / "trainable.safetensors").is_file() and not _exports_ema(path):
        state = _read_weights(path / "trainable.safetensors")
        try:
            policy.load_trainable_state_dict(state)
        except ValueError as err:
            raise CompareError(
                f"checkpoint '{path}': {err}; compare it with the config it was trained with"
            ) from None
        return
    from peft.utils import set_peft_model_state_dict

    state = _lora_file(path / "pytorch_lora_weights.safetensors")
    second = path / "transformer_2" / "pytorch_lora_weights.safetensors"
    if second.is_file():  # Wan2.2's two experts (Wan22Adapter.save_lora): high here, low there
        state = {**_prefixed(state, "high."), **_prefixed(_lora_file(second), "low.")}
    result = set_peft_model_state_dict(policy.transformer, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise CompareError(
            f"checkpoint '{path}': LoRA keys do not match this model (e.g. {unexpected[:2]}); "
            "is it for the config's model family and LoRA targets?"
        )


def _exports_ema(path: Path) -> bool:
    """Whether a checkpoint's diffusers export holds the EMA weights (its evaluations'),
    which are then the ones compared; ``trainable.safetensors`` holds the trained ones."""
    import json

    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    exported = str(meta.get("weights", {}).get("export", ""))
    return exported.startswith("EMA") and (path / "pytorch_lora_weights.safetensors").is_file()


def _read_weights(file: Path) -> dict:
    """A .safetensors file's tensors, or one CompareError if it is damaged."""
    from safetensors.torch import load_file

    from diffrl.training.checkpoint import safetensors_problem

    problem = safetensors_problem(file)
    if problem is None:
        try:
            return load_file(str(file), device="cpu")
        except Exception as err:  # noqa: BLE001 - any reader failure means a damaged file
            problem = f"{file.name} does not load ({err})"
    raise CompareError(f"checkpoint '{file.parent}': {problem}; pass an intact checkpoint (another step-N)")


def generate(adapter, model, prompts: list[str], seeds: list[int], steps: int, cfg) -> torch.Tensor:
    """Images for every (prompt, seed), prompt-major, from the evaluation noise keys."""
    rows, keys = eval_plan(prompts, len(prompts), seeds)  # the keys evaluation uses
    cond = adapter.encode_prompts(rows)
    with torch.no_grad():
        traj = rollout_independent(adapter, model, cond, keys, cfg, num_steps=steps, kinds=["ode"] * steps)
    return traj.images.cpu()


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
    adapter,
    policy,
    columns: list[Column],
    prompts: list[str],
    seeds: list[int],
    steps: int,
    cfg,
    reward_fn=None,
) -> list[Tile]:
    """Sample and score every tile; columns sharing a checkpoint load it once."""
    tiles: list[Tile] = []
    loaded = None
    for column in columns:
        if column.path is None:
            with policy.reference() as base:
                images = generate(adapter, base, prompts, seeds, steps, cfg)
        else:
            if loaded != column.path:
                load_weights(policy, column.path)
                loaded = column.path
            images = generate(adapter, column_model(policy, column), prompts, seeds, steps, cfg)
        scores = _score(reward_fn, images, prompts, seeds)
        for row, image in enumerate(images):
            i, s = divmod(row, len(seeds))
            tiles.append(Tile(prompts[i], i, seeds[s], column.name, image, scores[row]))
    _add_deltas(tiles)
    return tiles


def _score(reward_fn, images, prompts, seeds) -> list[dict[str, float]]:
    if reward_fn is None:
        return [{} for _ in range(len(images))]
    rows = [p for p in prompts for _ in seeds]
    _, _, logs = reward_fn(images, rows, {})
    # a NaN score does not apply to that image (e.g. a per-kind breakdown): leave it out
    return [{k: float(v[r]) for k, v in logs.items() if not torch.isnan(v[r])} for r in range(len(images))]


def _add_deltas(tiles: list[Tile]) -> None:
    base = {(t.prompt_index, t.seed): t.scores for t in tiles if t.column == "base"}
    for t in tiles:
        ref = base.get((t.prompt_index, t.seed))
        if ref is not None:
            t.delta = {k: v - ref[k] for k, v in t.scores.items() if k in ref}
