"""Reading a run's checkpoints: finding them, checking them against the file list their
``meta.json`` records, and telling a checkpoint's model from a config's. Training writes
and resumes them (:mod:`diffrl.training.checkpoint`); an inference session reads them
without their optimizer or RNG state (:mod:`diffrl.inference.weights`).

``<run>/checkpoints/step-N/`` holds the weights its evaluations scored in diffusers
format, ``trainable.safetensors`` (the exact fp32 trainable tensors), accelerate's
optimizer, schedule, RNG and registered objects (:data:`REGISTERED`: the LR schedule, the
counters, the EMA, the old policy), ``config.yaml`` and ``meta.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rewards.errors import UserError

_STEP_DIR = re.compile(r"^step-(\d+)$")
# what every checkpoint holds; checked by name when meta.json predates its file list
REQUIRED = ("trainable.safetensors", "optimizer.bin", "random_states_0.pkl")
# the objects the trainer registers with accelerate, in this order; accelerate names their
# files by position (custom_checkpoint_<i>.pkl), so this order is how a reader finds them
REGISTERED = ("scheduler", "counters", "ema", "old_policy", "prompt_history", "refiner")


class CheckpointError(UserError, RuntimeError):
    pass


def registered(ema: bool, old_policy: bool, prompt_history: bool = False, refiner: bool = False) -> list[str]:
    """The registered objects of a run with (or without) an EMA, an old policy, DDPO's
    per-prompt reward history (``advantage.estimator: prompt_history``) and PromptRL's
    trained refiner (its weights and optimizer), in order."""
    present = {
        "scheduler": True,
        "counters": True,
        "ema": ema,
        "old_policy": old_policy,
        "prompt_history": prompt_history,
        "refiner": refiner,
    }
    return [name for name in REGISTERED if present[name]]


def registered_file(path: Path, name: str, ema: bool, old_policy: bool = False) -> Path:
    """The file of registered object ``name`` in checkpoint ``path``."""
    return Path(path) / f"custom_checkpoint_{registered(ema, old_policy).index(name)}.pkl"


def open_to_the_umask(root: Path) -> None:
    """Give every file under ``root`` (and ``root`` itself, if a file) the mode the process's
    umask gives a new file (0644 under the usual 022). safetensors creates its files 0600,
    and ``shutil.copy2`` keeps that, so colleagues on a shared disk could not read a
    checkpoint or an export (issue 62, item 11)."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    mode = 0o666 & ~umask
    root = Path(root)
    for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def find_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint (``step-N`` with ``meta.json``), else the newest
    complete checkpoint of the run directory ``path`` (or of its ``checkpoints/``); a
    :class:`CheckpointError` naming what was looked for otherwise."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    run_dir = path.parent if path.name == "checkpoints" else path
    latest = latest_complete(run_dir)
    if latest is None:
        raise CheckpointError(
            f"{path} is neither a checkpoint (a step-N folder with meta.json) nor a run directory with a "
            "complete checkpoint under checkpoints/"
        )
    return latest[1]


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


def settings_differences(saved_config: Path, cfg_section: dict, section: str) -> list[str]:
    """'model.lora.rank is 8 there and 16 here' for each key of config section ``section``
    (``cfg_section``: this config's, as a dict) that differs from the checkpoint's
    ``saved_config``; nothing when there is no saved config."""
    if not Path(saved_config).is_file():
        return []
    import yaml

    saved = (yaml.safe_load(Path(saved_config).read_text()) or {}).get(section, {})
    diffs: list[str] = []

    def walk(a, b, prefix):
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if isinstance(x, dict) and isinstance(y, dict):
                walk(x, y, f"{prefix}{key}.")
            elif x != y:
                diffs.append(f"{prefix}{key} is {x!r} there and {y!r} here")

    walk(saved, cfg_section, f"{section}.")
    return diffs


# the settings that decide which objects a checkpoint registers (REGISTERED): an EMA, an
# old policy (the objective's), a per-prompt reward history (the advantage estimator)
STATE_SETTINGS = ("train.ema_decay", "objective.name", "advantage.estimator")


def state_settings_diff(saved_config: Path, cfg) -> str:
    """'; train.ema_decay is 0.9 there and 0.0 here' for each setting of
    :data:`STATE_SETTINGS` in which this config differs from the checkpoint's (a resume then
    meets other saved objects than it registers); nothing without a saved config."""
    if cfg is None or not Path(saved_config).is_file():
        return ""
    import yaml

    saved = yaml.safe_load(Path(saved_config).read_text()) or {}
    diffs = []
    for key in STATE_SETTINGS:
        section, name = key.split(".")
        there, here = (saved.get(section) or {}).get(name), getattr(getattr(cfg, section), name)
        if there is not None and there != here:
            diffs.append(f"{key} is {there!r} there and {here!r} here")
    return "".join(f"; {d}" for d in diffs) + (": resume with the run's own settings" if diffs else "")


def model_settings_diff(saved_config: Path, model_cfg) -> str:
    """'; model.lora.rank is 8 there and 16 here' for each model setting that differs."""
    if model_cfg is None:
        return ""
    import dataclasses

    diffs = settings_differences(saved_config, dataclasses.asdict(model_cfg), "model")
    return (
        ("; " + "; ".join(diffs[:4]) + "; resume with the checkpoint's model settings (its config.yaml)")
        if diffs
        else ""
    )
