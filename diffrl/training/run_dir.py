"""One run per run directory.

A new run into a directory that already holds a run would mix the two: ``metrics.jsonl``
appended to, ``config.yaml`` overwritten, the new checkpoints pruned at once by
``checkpoint.keep`` because the old run's higher steps count as newer, and
``--resume latest`` continuing the old run. So a fresh start requires an unused
directory, and the error offers the three ways on: resume, another directory, or
``--overwrite`` (which deletes what diffrl wrote there, and only that).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from diffrl.config import ConfigError

# what a run writes into its directory (diffrl.training.trainer, diffrl.training.checkpoint, accelerate)
RUN_FILES = ("metrics.jsonl", "config.yaml")
RUN_DIRS = ("checkpoints", "samples", "logs")


class RunDirInUseError(ConfigError):
    """A fresh run was started in a directory that holds another run."""


def previous_run(run_dir: Path) -> list[str]:
    """What an earlier run left in ``run_dir`` (empty when there is none)."""
    run_dir = Path(run_dir)
    found = [name for name in RUN_FILES if (run_dir / name).is_file()]
    found += [
        f"{name}/" for name in RUN_DIRS if (run_dir / name).is_dir() and any((run_dir / name).iterdir())
    ]
    return found


def ensure_fresh(run_dir: Path) -> None:
    """Raise :class:`RunDirInUseError` if ``run_dir`` holds an earlier run."""
    found = previous_run(run_dir)
    if found:
        raise RunDirInUseError(
            f"output_dir '{run_dir}' already holds a run ({', '.join(found)}). Continue it with "
            "--resume latest, "
            f"start elsewhere with --set output_dir=NEW_DIR, or replace it with --overwrite (deletes those)"
        )


def clear(run_dir: Path) -> list[str]:
    """Delete what an earlier run wrote into ``run_dir`` (other files stay); returns it."""
    run_dir = Path(run_dir)
    found = previous_run(run_dir)
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return found
