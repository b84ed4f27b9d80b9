"""Shared test helpers."""

import base64
import contextlib
import hashlib
import importlib.util
import os
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
TOOLS = SCRIPTS.parent / "tools"  # the project's own tooling


def load_script(name: str):
    """Import ``scripts/<name>.py`` (or ``tools/<name>.py``) as a module (neither folder is
    a package)."""
    path = SCRIPTS / f"{name}.py"
    path = path if path.is_file() else TOOLS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
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


def assert_save_and_lora_round_trip(tmp_path, build, cfg, pipeline_class, x, prompts) -> None:
    """A toy adapter saved with ``save_pretrained`` reloads to the same velocity, and a
    random LoRA saved with ``save_lora`` reloads through the pipeline's own
    ``load_lora_weights`` to the LoRA'd velocity. ``build(cfg)`` makes an adapter;
    ``cfg.pretrained`` is replaced by the saved directory."""
    import dataclasses

    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    def velocity(adapter):
        return adapter.velocity(adapter.transformer, x, sigma, adapter.encode_prompts(prompts))

    sigma = torch.tensor([0.3, 0.8])
    adapter = build(cfg)
    adapter.pipe.save_pretrained(tmp_path / "model")
    loaded = build(dataclasses.replace(cfg, pretrained=str(tmp_path / "model")))
    v0 = velocity(adapter)
    assert torch.equal(v0, velocity(loaded))
    targets = list(loaded.default_lora_targets)
    loaded.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, p in loaded.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    v_lora = velocity(loaded)
    loaded.save_lora(tmp_path / "lora", get_peft_model_state_dict(loaded.transformer))
    fresh = pipeline_class.from_pretrained(tmp_path / "model")
    fresh.load_lora_weights(tmp_path / "lora")
    assert not torch.allclose(v_lora, v0, atol=1e-4)
    assert torch.allclose(velocity(type(adapter)(fresh, cfg)), v_lora, atol=1e-5)


CHECKOUT_OUTPUTS = SCRIPTS.parent / "outputs"  # where a user's runs land by default (outputs/<run_name>)


def tree_state(root: Path, depth: int | None = None) -> dict[str, tuple[int, int]]:
    """Every entry under ``root``, ``depth`` levels down (all when None), as {relative path:
    (mtime_ns, size)}; an absent root is {}. A new file or folder changes its parent's
    mtime, so depth 2 under outputs/ (a run's files and its checkpoints/, samples/, logs/)
    sees every run that starts, continues or is deleted there, at a few stats a run."""
    root = Path(root)
    if not root.is_dir():
        return {}
    state = {".": (root.stat().st_mtime_ns, 0)}
    folders = [(root, 1)]
    while folders:
        folder, level = folders.pop()
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:  # deleted while we looked: the parent's mtime says so
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            state[os.path.relpath(entry.path, root)] = (st.st_mtime_ns, st.st_size)
            if entry.is_dir(follow_symlinks=False) and (depth is None or level < depth):
                folders.append((entry.path, level + 1))
    return state


def tree_changes(before: dict, after: dict) -> list[str]:
    """What differs between two :func:`tree_state` results, one line an entry."""
    lines = [f"created {p}" for p in sorted(after.keys() - before.keys())]
    lines += [f"deleted {p}" for p in sorted(before.keys() - after.keys())]
    lines += [f"modified {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return lines


def make_wheel(folder: Path, name: str, version: str, module_text: str = "", requires=()) -> Path:
    """A minimal pure-Python wheel (PEP 427: the files, METADATA, WHEEL and a RECORD of
    their hashes) holding one module ``name`` and declaring ``requires``."""
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name}.py": module_text,
        f"{info}/METADATA": metadata,
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: diffrl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }

    def digest(text: str) -> str:
        raw = hashlib.sha256(text.encode()).digest()
        return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    record = "".join(f"{path},{digest(text)},{len(text.encode())}\n" for path, text in files.items())
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for member, text in files.items():
            whl.writestr(member, text)
    return path


# -- the step-parity oracles (tests/recipes/test_step_parity*.py) -------------------------------
@contextlib.contextmanager
def adapters_off(model):
    """The references' ``with transformer.module.disable_adapter()``: the reference forward
    of a LoRA policy, as the oracles transcribe it (each call site cites its line)."""
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def rollout_with_rewards(cfg, rewards):
    """A trainer of ``cfg``, its iteration-0 rollout with the designed ``rewards`` in place
    of the sampled ones, and a copy of the policy as it sampled (the oracle's start)."""
    import copy

    import torch

    from diffrl.training.trainer import Trainer

    trainer = Trainer(cfg)
    r = trainer.rollout_and_score(0)
    r.total = torch.tensor(rewards)
    r.components = r.total[:, None]
    return trainer, r, copy.deepcopy(trainer.adapter.transformer)
