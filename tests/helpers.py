"""Shared test helpers."""

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    """Import ``scripts/<name>.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Killed(Exception):
    """Stands for the process being killed mid-run."""


def fit_until_killed(trainer, at_step: int) -> None:
    """Run ``trainer.fit()`` and 'kill' it when iteration ``at_step`` starts (after the
    checkpoints of the earlier iterations were written)."""
    original = trainer.train_step

    def dies(step):
        if step == at_step:
            raise Killed
        return original(step)

    trainer.train_step = dies
    with pytest.raises(Killed):
        trainer.fit()
