"""Self-describing, atomic checkpoints.

``<run>/checkpoints/step-N/`` holds:
  * the policy in diffusers format (``pytorch_lora_weights.safetensors`` that
    ``pipe.load_lora_weights(dir)`` loads, or ``transformer/`` for full fine-tuning);
  * ``trainable.safetensors``: the exact fp32 trainable tensors, for bit-exact resume;
  * accelerate's optimizer, LR schedule, per-process RNG states and registered objects
    (EMA, trainer counters);
  * ``config.yaml`` (resolved) and ``meta.json`` (step, library version, time).
Everything is written into ``.tmp-step-N`` first and renamed into place, so a run killed
mid-save never leaves a half checkpoint that ``--resume latest`` would pick up.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

import diffrl
from diffrl.config import save_config

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    pass


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def resolve_resume(spec: str, run_dir: Path) -> Path:
    """``latest`` -> newest complete checkpoint of the run; otherwise a checkpoint path."""
    if spec == "latest":
        found = list_checkpoints(run_dir)
        if not found:
            raise CheckpointError(f"--resume latest: no checkpoints under {checkpoint_root(run_dir)}; "
                                  "run without --resume to start fresh, or pass a checkpoint directory")
        return found[-1][1]
    path = Path(spec)
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"--resume {spec}: not a diffrl checkpoint directory (no meta.json); "
                              f"expected e.g. {checkpoint_root(run_dir)}/step-N")
    return path


def save_checkpoint(accelerator, policy, cfg, step: int, keep: int = 0) -> Path:
    """Collective: every process must call it (accelerate writes per-process RNG state)."""
    root = checkpoint_root(cfg.run_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        policy.save_pretrained(tmp)
        save_file({k: v.contiguous().cpu() for k, v in policy.trainable_state_dict().items()},
                  str(tmp / "trainable.safetensors"))
        save_config(cfg, tmp / "config.yaml")
        meta = {"step": step, "diffrl_version": diffrl.__version__, "time": time.time()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(cfg.run_dir, keep)
    accelerator.wait_for_everyone()
    return final


def _prune(run_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(accelerator, policy, path: Path) -> int:
    """Restore optimizer, schedule, RNG, registered objects and the exact trainable
    weights; returns the step the checkpoint was taken after."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    accelerator.load_state(str(path))
    policy.load_trainable_state_dict(load_file(str(path / "trainable.safetensors"), device="cpu"))
    return int(meta["step"])


def install_accelerate_hooks(accelerator) -> None:
    """Stop accelerate from writing the full transformer (base weights included) into every
    checkpoint: diffrl writes the trainable weights itself. Same pattern as the diffusers
    LoRA training scripts."""

    def skip_model_weights(models, weights, output_dir):
        weights.clear()

    def skip_model_loading(models, input_dir):
        models.clear()

    accelerator.register_save_state_pre_hook(skip_model_weights)
    accelerator.register_load_state_pre_hook(skip_model_loading)
