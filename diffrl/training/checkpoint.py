"""Self-describing, atomic checkpoints.

``<run>/checkpoints/step-N/`` holds:
  * the weights the run's evaluations score, in diffusers format
    (``pytorch_lora_weights.safetensors`` that ``pipe.load_lora_weights(dir)`` loads, or
    ``transformer/`` for full fine-tuning): the EMA weights when ``train.ema_decay`` > 0
    (flow_grpo saves its EMA too), else the trained ones; with an EMA, the trained (raw)
    weights also, in ``raw/``, the same layout. ``meta.json`` says which is which
    (``weights``);
  * ``trainable.safetensors``: the exact fp32 trainable tensors, for bit-exact resume;
  * accelerate's optimizer, LR schedule, per-process RNG states and registered objects
    (EMA, trainer counters);
  * ``config.yaml`` (resolved) and ``meta.json`` (step, library version, time, and the
    size of every other file).
Everything is written into ``.tmp-step-N`` first and renamed into place, so a run killed
mid-save never leaves a half checkpoint that ``--resume latest`` would pick up. Damage
after the fact (a deleted optimizer.bin, a truncated copy, an empty directory) is found
by :func:`checkpoint_problem` against that list: ``--resume latest`` skips such a
checkpoint, says why, and takes the newest complete one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

import diffrl
from diffrl.config import save_config
from diffrl.inference.checkpoints import (
    CheckpointError,
    checkpoint_problem,
    checkpoint_root,
    list_checkpoints,
    model_settings_diff,
    open_to_the_umask,
    state_settings_diff,
    weights_mismatch,
)
from diffrl.inference.weights import REFINER_WEIGHTS
from diffrl.runtime.sharding import is_sharded


def save_checkpoint(accelerator, policy, cfg, step: int, keep: int = 0, ema=None, refiner=None) -> Path:
    """Collective: every process must call it (accelerate writes per-process RNG state).
    With an ``ema`` (:class:`~diffrl.training.ema.EMA` of the trainable weights), its
    weights are the diffusers export and the trained ones go to ``raw/``. With PromptRL's
    ``refiner``, ``refiner/`` holds it as users load it (a PEFT adapter or the whole LM,
    with its tokenizer) and its exact trained tensors (``refiner/trained.safetensors``)."""
    root = checkpoint_root(cfg.run_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with _no_fsdp_model_files(accelerator):
        accelerator.save_state(str(tmp))
    trainable = policy.trainable_state_dict()  # every process: under FSDP it gathers the shards
    averaged = ema.named_state_dict(policy) if ema is not None else None  # collective too
    if accelerator.is_main_process:
        if averaged is None:
            policy.save_pretrained(tmp, trainable)
        else:
            # a whole full fine-tune is exported from the live module: the EMA swapped in
            live = not policy.is_lora and not any(is_sharded(p) for p in policy.transformer.parameters())
            with ema.swapped_in() if live else contextlib.nullcontext():
                policy.save_pretrained(tmp, averaged)
            policy.save_pretrained(tmp / "raw", trainable)
        save_file({k: v.contiguous().cpu() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
        if refiner is not None:
            refiner.save_pretrained(tmp / "refiner")
            save_file(refiner.trained_state(), str(tmp / REFINER_WEIGHTS))
        save_config(cfg, tmp / "config.yaml")
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        meta = {"step": step, "diffrl_version": diffrl.__version__, "time": time.time(), "files": files}
        meta["weights"] = _weights_note(ema)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        open_to_the_umask(tmp)  # safetensors writes 0600: a shared disk's colleagues could not read it
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(cfg.run_dir, keep)
    accelerator.wait_for_everyone()
    return final


def _weights_note(ema) -> dict:
    """Which weights each file holds, and which the run's evaluations scored."""
    if ema is None:
        return {"export": "trained", "evaluated": "trained", "trainable.safetensors": "trained"}
    return {
        "export": f"EMA ({ema_schedule(ema)}; {ema.updates} updates in {ema.steps} optimizer steps)",
        "raw/": "trained",
        "evaluated": "EMA",
        "trainable.safetensors": "trained (exact resume; the EMA resumes from accelerate's state)",
    }


def ema_schedule(ema) -> str:
    """The EMA's schedule in words, as the settings that made it."""
    words = [f"decay {ema.decay}"]
    if ema.every > 1:
        words.append(f"every {ema.every} steps")
    if ema.repeats > 1:
        words.append(f"applied {ema.repeats}x")
    if ema.warmup:
        words.append("warm-up (1+n)/(10+n)")
    return ", ".join(words)


def keep_as_best(accelerator, run_dir: Path, path: Path, name: str = "best") -> Path:
    """Copy the checkpoint at ``path`` to ``checkpoints/<name>`` (main process), out of the
    rotation's reach (it prunes ``step-N`` only), replacing the one kept before."""
    root = checkpoint_root(run_dir)
    best, tmp = root / name, root / f".tmp-{name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(path, tmp)
        shutil.rmtree(best, ignore_errors=True)
        tmp.rename(best)
    accelerator.wait_for_everyone()
    return best


def _prune(run_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(accelerator, policy, path: Path, model_cfg=None, cfg=None) -> int:
    """Restore optimizer, schedule, RNG, registered objects and the exact trainable
    weights; returns the step the checkpoint was taken after. A damaged checkpoint, or one
    of a different model (LoRA rank or targets, full fine-tuning), is one
    :class:`CheckpointError` that names the difference; nothing is loaded then."""
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem:
        raise CheckpointError(f"cannot resume from {path}: {problem}")
    meta = json.loads((path / "meta.json").read_text())
    try:
        state = load_file(str(path / "trainable.safetensors"), device="cpu")
    except Exception as err:  # noqa: BLE001 - any reader failure means a damaged file
        raise CheckpointError(
            f"cannot resume from {path}: trainable.safetensors does not load ({err})"
        ) from None
    mismatch = weights_mismatch(state, dict(policy.trainable_named_parameters()))
    if mismatch:
        raise CheckpointError(
            f"cannot resume from {path}: it holds a different model than this run's ({mismatch})"
            + model_settings_diff(path / "config.yaml", model_cfg)
        )
    try:
        with _no_fsdp_model_files(accelerator):
            accelerator.load_state(str(path))
    except Exception as err:  # noqa: BLE001 - accelerate's pickles and optimizer state
        first = str(err).splitlines()[0] if str(err) else ""
        raise CheckpointError(
            f"cannot resume from {path}: its optimizer / RNG state does not load "
            f"({type(err).__name__}: {first})" + state_settings_diff(path / "config.yaml", cfg)
        ) from None
    policy.load_trainable_state_dict(state)
    return int(meta["step"])


@contextlib.contextmanager
def _no_fsdp_model_files(accelerator):
    """Under FSDP, accelerate's save_state writes the whole transformer (frozen base
    included; 24 GB for FLUX) before any pre-hook can stop it, and load_state reads it
    back. diffrl writes the trainable weights itself (trainable.safetensors), as it does
    without FSDP, so the two model calls are no-ops for the duration; the sharded
    optimizer state is still saved and loaded by accelerate."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        yield
        return
    import accelerate.accelerator as module

    kept = module.save_fsdp_model, module.load_fsdp_model
    module.save_fsdp_model = module.load_fsdp_model = lambda *args, **kwargs: None
    try:
        yield
    finally:
        module.save_fsdp_model, module.load_fsdp_model = kept


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
