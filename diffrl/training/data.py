"""Prompt files and the per-iteration sample plan.

The plan for iteration ``step`` depends only on (seed, step), never on global RNG
state, so resuming at step k reproduces exactly the prompts and noise keys an
uninterrupted run would have used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.sampling import rng
from rewards.prompts import EditPrompt


class PromptFileError(ValueError):
    """A prompt file is missing, empty or malformed; the message names file and line."""


# the checkout's root: shipped configs name their prompt files relative to it
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve_prompt_path(path: str | Path) -> Path:
    """A relative prompt path as given if it exists from the working directory, else
    relative to the project root (so ``assets/shapeworld/train.txt`` in a shipped config
    works from any directory). Absolute paths are taken as they are."""
    path = Path(path).expanduser()
    if path.is_absolute() or path.is_file():
        return path
    shipped = PROJECT_ROOT / path
    return shipped if shipped.is_file() else path


def load_prompts(path: str | Path) -> list[str]:
    """Read prompts from a file or a named prompt set (docs/DATA.md: ``geneval/eval``,
    ``pickscore/train``..., fetched by ``diffrl-data fetch NAME``; a set of several files
    reads them in order). Files: ``.txt`` (one per line, blank lines and ``#`` comments
    skipped), ``.jsonl`` (one object per line with a string ``prompt`` field and, for
    editing runs, an optional string ``image`` field: the input image's path, relative to
    the prompt file's folder unless absolute; GenEval's metadata lines load as they are),
    ``.csv`` (a ``Prompts`` or ``prompt`` column: DrawBench) or ``.json`` (a list of
    strings: the HPDv2 benchmark). Lines with an image become
    :class:`~rewards.prompts.EditPrompt`; a file mixing lines with and without one is
    refused. A relative path is looked up from the working directory, then from the
    project root."""
    from diffrl.data import is_set_name, local_files

    if is_set_name(str(path)) and not resolve_prompt_path(path).is_file():
        return [p for file in local_files(str(path)) for p in _load_file(file, file)]
    return _load_file(path, resolve_prompt_path(path))


def _load_file(given, path: Path) -> list[str]:
    if not path.is_file():
        raise PromptFileError(
            f"prompt file '{given}' does not exist (looked in {Path.cwd()} and {PROJECT_ROOT}); "
            "set data.train_prompts / data.eval_prompts to a .txt (one prompt per line) or .jsonl file, "
            "or to a prompt set name (diffrl-data list)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise PromptFileError(
            f"prompt file '{path}' is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    if path.suffix == ".csv":
        prompts = _csv_prompts(path, text)
    elif path.suffix == ".json":
        prompts = _json_prompts(path, text)
    else:
        prompts = _line_prompts(path, text)
    if not prompts:
        raise PromptFileError(f"prompt file '{path}' has no prompts")
    with_image = sum(isinstance(p, EditPrompt) for p in prompts)
    if 0 < with_image < len(prompts):
        raise PromptFileError(
            f"prompt file '{path}': {with_image} of {len(prompts)} prompts have an 'image' and the "
            "rest do not; an editing run needs an image on every line, a text-to-image run on none"
        )
    return prompts


def _line_prompts(path: Path, text: str) -> list[str]:
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        prompts.append(_jsonl_prompt(path, lineno, line) if path.suffix == ".jsonl" else line)
    return prompts


def _csv_prompts(path: Path, text: str) -> list[str]:
    import csv
    import io

    reader = csv.DictReader(io.StringIO(text))
    column = next(
        (c for c in ("Prompts", "prompt", "Prompt", "prompts") if c in (reader.fieldnames or [])), None
    )
    if column is None:
        raise PromptFileError(
            f"prompt file '{path}': a .csv needs a 'Prompts' or 'prompt' column, found {reader.fieldnames}"
        )
    return [row[column].strip() for row in reader if (row.get(column) or "").strip()]


def _json_prompts(path: Path, text: str) -> list[str]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PromptFileError(f"{path}: invalid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
        raise PromptFileError(f"prompt file '{path}': a .json prompt file is a list of strings")
    return [p.strip() for p in data if p.strip()]


def check_image_column(prompts: list[str], path, family: str) -> None:
    """An editing family (``FlowAdapter.edits_images``) needs an input image on every
    prompt, and a text-to-image family would silently ignore them: refuse both."""
    from diffrl.models import adapter_class

    if not prompts:  # no evaluation
        return
    edits = adapter_class(family).edits_images
    with_image = isinstance(prompts[0], EditPrompt)
    if edits and not with_image:
        raise PromptFileError(
            f"model family '{family}' edits images, but prompt file '{path}' has no 'image' column; "
            'use a .jsonl file with lines like {"prompt": "make the red circle blue", "image": "in/0.png"}'
        )
    if with_image and not edits:
        raise PromptFileError(
            f"prompt file '{path}' gives input images, but model family '{family}' generates from text "
            "only and would ignore them; use an editing family (flux_kontext, qwenimage_edit) or a "
            "file without 'image'"
        )


def _jsonl_prompt(path: Path, lineno: int, line: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise PromptFileError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
        raise PromptFileError(f"{path}:{lineno}: expected an object with a string 'prompt' field")
    image = obj.get("image")
    if image is None:
        return obj["prompt"]
    if not isinstance(image, str) or not image:
        raise PromptFileError(f"{path}:{lineno}: 'image' must be a file path string, got {image!r}")
    image_path = Path(image).expanduser()
    image_path = image_path if image_path.is_absolute() else path.parent / image_path
    if not image_path.is_file():
        raise PromptFileError(
            f"{path}:{lineno}: input image '{image}' does not exist (looked for {image_path}); "
            "image paths are relative to the prompt file's folder"
        )
    return EditPrompt(obj["prompt"], image_path.resolve())


@dataclass
class SamplePlan:
    """The samples of one iteration, in global order (group-major)."""

    prompts: list[str]  # (N,)
    group_ids: torch.Tensor  # (N,) group index within the step
    keys: list[tuple]  # (N,) RNG keys (seed, step, group, sample)

    def shard(self, rank: int, world: int) -> tuple[slice, SamplePlan]:
        """Contiguous block of this process; groups may straddle processes (stats are gathered)."""
        n = len(self.prompts)
        if n % world:
            raise ValueError(
                f"{n} samples per step cannot be split over {world} processes; make "
                "rollout.prompts_per_step * rollout.group_size divisible by the process count"
            )
        per = n // world
        sl = slice(rank * per, (rank + 1) * per)
        return sl, SamplePlan(self.prompts[sl], self.group_ids[sl], self.keys[sl])


def plan_step(prompts: list[str], seed: int, step: int, prompts_per_step: int, group_size: int) -> SamplePlan:
    """Choose ``prompts_per_step`` prompts for ``step`` (without replacement when possible)
    and lay out ``group_size`` samples of each."""
    gen = rng.generator(seed, "prompts", step)
    order = torch.cat(
        [torch.randperm(len(prompts), generator=gen) for _ in range(-(-prompts_per_step // len(prompts)))]
    )[:prompts_per_step]
    chosen, group_ids, keys = [], [], []
    for g, idx in enumerate(order.tolist()):
        for s in range(group_size):
            chosen.append(prompts[idx])
            group_ids.append(g)
            keys.append((seed, step, g, s))
    return SamplePlan(chosen, torch.tensor(group_ids), keys)
