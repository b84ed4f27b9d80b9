"""Weights for a policy to sample with, read without a checkpoint's optimizer or RNG state.

A directory is one of three kinds, told apart by what it holds:

* a diffrl checkpoint (``trainable.safetensors``): its weights by ``which``:
  ``trained`` (the exact fp32 trainable tensors), ``ema`` (the EMA the run kept, from
  accelerate's state of its registered objects, :data:`~diffrl.inference.checkpoints.REGISTERED`)
  or ``evaluated`` (the ones its evaluations scored, which ``meta.json`` records: the EMA
  when the run kept one);
* a diffusers LoRA (``pytorch_lora_weights.safetensors``, and ``transformer_2/`` for
  Wan2.2's low-noise expert): the policy's own adapter takes it;
* a full fine-tune (``transformer/``, with a ``full_finetune`` config): its module weights.

Every mismatch (another LoRA rank or targets, a damaged file) is one
:class:`~diffrl.inference.checkpoints.CheckpointError` naming the checkpoint and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffrl.inference.checkpoints import (
    CheckpointError,
    model_settings_diff,
    registered_file,
    safetensors_problem,
    weights_mismatch,
)

WHICH = ("evaluated", "trained", "ema")


def holds_weights(path: Path) -> bool:
    """Whether ``path`` is a directory of one of the three kinds."""
    kinds = ("trainable.safetensors", "pytorch_lora_weights.safetensors", "transformer")
    return any((Path(path) / f).exists() for f in kinds)


def load_weights(policy, path: Path, which: str = "evaluated", model_cfg=None) -> str:
    """Load the weights at ``path`` into ``policy``; returns what was loaded, in words.
    ``model_cfg``: the config's model section, named in a mismatch's error."""
    path = Path(path)
    if which not in WHICH:
        raise CheckpointError(f"weights '{which}': use one of {', '.join(WHICH)}")
    trainable = path / "trainable.safetensors"
    if not policy.is_lora and (path / "transformer").is_dir() and not trainable.is_file():
        full = type(policy.transformer).from_pretrained(str(path / "transformer"))
        policy.transformer.load_state_dict(full.state_dict())
        return "the full fine-tune's transformer/"
    if trainable.is_file():
        kind = resolved_which(path, which)
        state = _read_weights(trainable) if kind == "trained" else ema_weights(path, policy)
        _load_trainable(policy, state, path, model_cfg)
        return f"the {'EMA' if kind == 'ema' else 'trained'} weights of {path}"
    if which == "ema":
        raise CheckpointError(f"checkpoint '{path}': a diffusers LoRA holds one set of weights; drop 'ema'")
    _load_diffusers_lora(policy, path)
    return f"the diffusers LoRA {path}"


# the refiner's trained weights in a checkpoint (beside refiner/'s PEFT or LM folder)
REFINER_WEIGHTS = Path("refiner") / "trained.safetensors"


def load_refiner_weights(refiner, path: Path) -> str:
    """The trained refiner of checkpoint ``path`` into ``refiner``; a checkpoint without one
    (a run without the refiner, an outside LoRA) leaves the refiner as it was built."""
    file = Path(path) / REFINER_WEIGHTS
    if not file.is_file():
        return "the refiner as refiner.model gives it (the checkpoint has none)"
    refiner.load_trained_state(_read_weights(file))
    return f"the trained refiner of {path}"


def resolved_which(path: Path, which: str) -> str:
    """``trained`` or ``ema``: ``evaluated`` resolved by what the checkpoint says its
    evaluations scored (``meta.json``; before that record, by its config's EMA)."""
    if which != "evaluated":
        return which
    meta = _read_json(path / "meta.json") or {}
    evaluated = meta.get("weights", {}).get("evaluated")
    if evaluated is not None:
        return "ema" if evaluated == "EMA" else "trained"
    return "ema" if saved_ema_decay(path) > 0 else "trained"


def saved_ema_decay(path: Path) -> float:
    """``train.ema_decay`` of the checkpoint's own config.yaml (0 without one)."""
    import yaml

    file = Path(path) / "config.yaml"
    saved = yaml.safe_load(file.read_text()) if file.is_file() else {}
    return float((saved or {}).get("train", {}).get("ema_decay", 0.0) or 0.0)


def ema_weights(path: Path, policy) -> dict[str, torch.Tensor]:
    """The EMA of the checkpoint's trainable weights, by the policy's trainable names
    (the EMA keeps them as a list in that order)."""
    if saved_ema_decay(path) <= 0:
        raise CheckpointError(
            f"checkpoint '{path}' was trained without an EMA (train.ema_decay 0): score its "
            "trained weights (weights 'trained' or 'evaluated')"
        )
    file = registered_file(path, "ema", ema=True)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
        shadow = list(state["shadow"])
    except Exception as err:  # noqa: BLE001 - a missing or damaged pickle, said in one line
        raise CheckpointError(
            f"checkpoint '{path}': its EMA state {file.name} does not load ({err})"
        ) from None
    names = [n for n, _ in policy.trainable_named_parameters()]
    if len(names) != len(shadow):
        raise CheckpointError(
            f"checkpoint '{path}': its EMA holds {len(shadow)} tensors and this policy trains "
            f"{len(names)}; score it with the config it was trained with"
        )
    return dict(zip(names, shadow))


def _load_trainable(policy, state: dict, path: Path, model_cfg) -> None:
    mismatch = weights_mismatch(state, dict(policy.trainable_named_parameters()))
    if mismatch:
        raise CheckpointError(
            f"checkpoint '{path}' holds a different model than this config's ({mismatch})"
            + model_settings_diff(path / "config.yaml", model_cfg)
        )
    policy.load_trainable_state_dict(state)


def _lora_file(path: Path) -> dict:
    return {k.removeprefix("transformer."): v for k, v in _read_weights(path).items()}


def _load_diffusers_lora(policy, path: Path) -> None:
    from peft.utils import set_peft_model_state_dict

    state = _lora_file(path / "pytorch_lora_weights.safetensors")
    second = path / "transformer_2" / "pytorch_lora_weights.safetensors"
    if second.is_file():  # Wan2.2's two experts (Wan22Adapter.save_lora): high here, low there
        state = {**_prefixed(state, "high."), **_prefixed(_lora_file(second), "low.")}
    result = set_peft_model_state_dict(policy.transformer, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise CheckpointError(
            f"checkpoint '{path}': LoRA keys do not match this model (e.g. {unexpected[:2]}); "
            "is it for the config's model family and LoRA targets?"
        )


def _prefixed(state: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in state.items()}


def _read_json(file: Path) -> dict | None:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def _read_weights(file: Path) -> dict:
    """A .safetensors file's tensors, or one CheckpointError if it is damaged."""
    from safetensors.torch import load_file

    problem = safetensors_problem(file)
    if problem is None:
        try:
            return load_file(str(file), device="cpu")
        except Exception as err:  # noqa: BLE001 - any reader failure means a damaged file
            problem = f"{file.name} does not load ({err})"
    raise CheckpointError(
        f"checkpoint '{file.parent}': {problem}; pass an intact checkpoint (another step-N)"
    )
