"""Shared test helpers."""

import pytest


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
