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


def family_prompts(family: str, texts: list[str]) -> list[str]:
    """``texts`` as prompts for ``family``: an editing family (Kontext) gets each distinct
    text paired with a shipped ShapeWorld source image (equal texts, equal images)."""
    from diffrl.models import adapter_class

    if not adapter_class(family).edits_images:
        return list(texts)
    from rewards.prompts import EditPrompt

    sources = sorted((SCRIPTS.parent / "assets" / "shapeworld" / "edit" / "images").glob("train_*.png"))
    index = {t: i for i, t in enumerate(dict.fromkeys(texts))}
    return [EditPrompt(t, sources[index[t]]) for t in texts]


def quick_config(name: str, run_dir, *overrides):
    """Config ``name`` writing to ``run_dir``, cut to 2 iterations with no evaluation, no
    checkpoints and no progress bar; ``overrides`` come last and win."""
    from diffrl.config import load_config

    quick = ["train.max_steps=2", "eval.every=0", "checkpoint.every=0", "logging.progress_bar=false"]
    return load_config(name, [f"output_dir={run_dir}", *quick, *overrides])


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


class NanEvery:
    """A reward (registered by tests as ``nan_every``): JPEG size in kB, except NaN for
    every ``every``-th sample of each call (all of them with ``every=1``), as a reward
    model that breaks on some inputs does."""

    name = "nan_every"

    def __init__(self, every: int = 4):
        self.every = int(every)

    def __call__(self, images, prompts=None, metadata=None):
        import torch

        from rewards.jpeg import jpeg_size_kb

        size = jpeg_size_kb(images)
        size[torch.arange(len(size)) % self.every == 0] = float("nan")
        return {self.name: size}
