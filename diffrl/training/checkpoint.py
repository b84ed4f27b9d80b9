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
import re
import shutil
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

import diffrl
from diffrl.config import save_config
from diffrl.runtime.sharding import is_sharded
from rewards.errors import UserError

_STEP_DIR = re.compile(r"^step-(\d+)$")
# what every checkpoint holds; checked by name when meta.json predates its file list
REQUIRED = ("trainable.safetensors", "optimizer.bin", "random_states_0.pkl")


class CheckpointError(UserError, RuntimeError):
    pass


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def resolve_resume(spec: str, run_dir: Path, log=print) -> Path:
    """``latest`` -> the newest *complete* checkpoint of the run (each damaged newer one is
    skipped with a note saying why); otherwise a checkpoint path, which must be complete."""
    if spec != "latest":
        path = Path(spec)
        problem = checkpoint_problem(path)
        if problem:
            raise CheckpointError(
                f"--resume {spec}: {problem}; pass a complete checkpoint directory such as "
                f"{checkpoint_root(run_dir)}/step-N, or --resume latest"
            )
        return path
    latest = latest_complete(
        run_dir, log=lambda path, problem: log(f"note: --resume latest skips {path}: {problem}")
    )
    if latest is not None:
        return latest[1]
    what = "no complete checkpoint" if list_checkpoints(run_dir) else "no checkpoints"
    raise CheckpointError(
        f"--resume latest: {what} under {checkpoint_root(run_dir)}; start over with --overwrite, "
        "or pass a checkpoint directory"
    )


def latest_complete(run_dir: Path, log=None) -> tuple[int, Path] | None:
    """(step, path) of the newest complete checkpoint of the run, or None; ``log(path,
    problem)`` is told of each damaged newer one that was passed over."""
    for step, path in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return step, path
        if log is not None:
            log(path, problem)
    return None


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None if it is."""
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    if not any(path.iterdir()):
        return "the directory is empty"
    if not (path / "meta.json").is_file():
        return "no meta.json (not a diffrl checkpoint, or its save was interrupted)"
    try:
        meta = json.loads((path / "meta.json").read_text())
        int(meta["step"])
    except (ValueError, KeyError, TypeError):
        return "meta.json is damaged (not JSON with a 'step')"
    files = meta.get("files") or {name: None for name in REQUIRED}
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if size is not None and f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} when it was saved (truncated or replaced)"
    return safetensors_problem(path / "trainable.safetensors")


def safetensors_problem(path: Path) -> str | None:
    """Check a .safetensors file against its format: an 8-byte little-endian header length,
    a JSON header of tensor byte ranges, then exactly the bytes those ranges cover."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{path.name} is truncated (no header)"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"{path.name} is truncated (its header says {n} bytes, {size - 8} follow)"
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            return f"{path.name} has a damaged header"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"{path.name} has {size} bytes where its header needs {expected} (truncated?)"
    return None


def save_checkpoint(accelerator, policy, cfg, step: int, keep: int = 0, ema=None) -> Path:
    """Collective: every process must call it (accelerate writes per-process RNG state).
    With an ``ema`` (:class:`~diffrl.training.policy.EMA` of the trainable weights), its
    weights are the diffusers export and the trained ones go to ``raw/``."""
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
        save_config(cfg, tmp / "config.yaml")
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        meta = {"step": step, "diffrl_version": diffrl.__version__, "time": time.time(), "files": files}
        meta["weights"] = _weights_note(ema)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
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


def _prune(run_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(accelerator, policy, path: Path, model_cfg=None) -> int:
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
            f"({type(err).__name__}: {first})"
        ) from None
    policy.load_trainable_state_dict(state)
    return int(meta["step"])


def weights_mismatch(saved: dict, current: dict) -> str | None:
    """The first difference between saved and current trainable tensors, in words."""
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        return (
            f"{len(missing)} of this run's trainable tensors are not in it and it has "
            f"{len(unexpected)} this run "
            f"lacks, e.g. '{(missing or unexpected)[0]}'"
        )
    for name in sorted(current):
        if tuple(saved[name].shape) != tuple(current[name].shape):
            return f"'{name}' is {list(saved[name].shape)} there and {list(current[name].shape)} here"
    return None


def model_settings_diff(saved_config: Path, model_cfg) -> str:
    """'; model.lora.rank is 8 there and 16 here' for each model setting that differs."""
    if model_cfg is None or not Path(saved_config).is_file():
        return ""
    import dataclasses

    import yaml

    saved = (yaml.safe_load(Path(saved_config).read_text()) or {}).get("model", {})
    now = dataclasses.asdict(model_cfg)
    diffs = []

    def walk(a, b, prefix):
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if isinstance(x, dict) and isinstance(y, dict):
                walk(x, y, f"{prefix}{key}.")
            elif x != y:
                diffs.append(f"{prefix}{key} is {x!r} there and {y!r} here")

    walk(saved, now, "model.")
    return (
        ("; " + "; ".join(diffs[:4]) + "; resume with the checkpoint's model settings (its config.yaml)")
        if diffs
        else ""
    )


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
