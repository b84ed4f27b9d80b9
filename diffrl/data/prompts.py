"""Reading prompts: one parser for every file format and prompt set, used by training,
evaluation and the papers' protocols alike.

A prompt source is a file or a named prompt set (docs/DATA.md: ``geneval/eval``,
``pickscore/train``..., fetched by ``diffrl-data fetch NAME``; a set of several files is
read in order). Each prompt comes back as a :class:`PromptRecord`: its text, its input
image (editing runs), its group (GenEval's task tag, DrawBench's category, the HPDv2
benchmark's style) and the raw metadata of its line. File formats:

* ``.txt``: one prompt per line, blank lines and ``#`` comments skipped;
* ``.jsonl``: one object per line with a string ``prompt`` field and, for editing runs,
  an optional string ``image`` field (the input image's path, relative to the prompt
  file's folder unless absolute); GenEval's metadata lines load as they are, their
  ``tag`` is the group;
* ``.csv``: a ``Prompts`` or ``prompt`` column (DrawBench), ``Category`` the group;
* ``.json``: a list of strings (the HPDv2 benchmark), the file's name the group.

A relative path is looked up from the working directory, then from the project root.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from rewards.errors import UserError
from rewards.prompts import AnnotatedPrompt, EditPrompt

# the checkout's root: shipped configs name their prompt files relative to it
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class PromptFileError(UserError, ValueError):
    """A prompt file is missing, empty or malformed; the message names file and line."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as its source gives it."""

    text: str
    image: Path | None = None  # an editing prompt's input image
    group: str | None = None  # task tag, category or style; None where the format has none
    metadata: dict = field(default_factory=dict)  # the line's own fields (a .jsonl object, a .csv row)

    @property
    def prompt(self) -> str:
        """What models and rewards take: the text, an :class:`EditPrompt` carrying the image,
        or, where the line has fields besides its text, an :class:`AnnotatedPrompt` carrying
        them (rewards score GenEval lines from their ``include`` / ``exclude``)."""
        if self.image is not None:
            return EditPrompt(self.text, self.image)
        besides_text = any(k.lower() not in ("prompt", "prompts") for k in self.metadata)
        return AnnotatedPrompt(self.text, self.metadata) if besides_text else self.text


def resolve_prompt_path(path: str | Path) -> Path:
    """A relative prompt path as given if it exists from the working directory, else
    relative to the project root (so ``assets/shapeworld/train.txt`` in a shipped config
    works from any directory). Absolute paths are taken as they are."""
    path = Path(path).expanduser()
    if path.is_absolute() or path.is_file():
        return path
    shipped = PROJECT_ROOT / path
    return shipped if shipped.is_file() else path


def read_prompts(source: str | Path) -> list[PromptRecord]:
    """Every prompt of a file or a named prompt set, in order (see the module docstring). A
    file mixing lines with and without an input image is refused."""
    from diffrl.data.registry import is_set_name
    from diffrl.data.store import local_files

    if is_set_name(str(source)) and not resolve_prompt_path(source).is_file():
        return [r for file in local_files(str(source)) for r in _read_file(file, file)]
    return _read_file(source, resolve_prompt_path(source))


def load_prompts(source: str | Path) -> list[str]:
    """The prompts of :func:`read_prompts` as models and rewards take them (text, or an
    :class:`~rewards.prompts.EditPrompt` where the line gives an input image)."""
    return [r.prompt for r in read_prompts(source)]


def _read_file(given, path: Path) -> list[PromptRecord]:
    if path.is_dir():
        raise PromptFileError(
            f"prompt file '{given}' is a directory ({path}); name a .txt, .jsonl, .csv or .json file in it, "
            "or a prompt set (diffrl-data list)"
        )
    if not path.is_file():
        from diffrl.data.registry import nearest_set_names

        places = sorted({str(Path.cwd()), str(PROJECT_ROOT)})
        near = nearest_set_names(str(given))
        if near:  # a misspelt set name, as `diffrl-data path` would have said
            raise PromptFileError(
                f"'{given}' is neither a prompt file nor a known prompt set; did you mean "
                f"{' or '.join(repr(n) for n in near)}? (diffrl-data list shows every set)"
            )
        raise PromptFileError(
            f"prompt file '{given}' does not exist (looked in {' and '.join(places)}); "
            "set data.train_prompts / data.eval_prompts to a .txt (one prompt per line) or .jsonl file, "
            "or to a prompt set name (diffrl-data list)"
        )
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is dropped, in every format;
        # kept, it became part of a .txt's first prompt and made a .jsonl's first line invalid
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise PromptFileError(
            f"prompt file '{path}' is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None
    if path.suffix == ".csv":
        records = _csv_records(path, text)
    elif path.suffix == ".json":
        records = _json_records(path, text)
    else:
        records = _line_records(path, text)
    if not records:
        raise PromptFileError(f"prompt file '{path}' has no prompts")
    with_image = sum(r.image is not None for r in records)
    if 0 < with_image < len(records):
        raise PromptFileError(
            f"prompt file '{path}': {with_image} of {len(records)} prompts have an 'image' and the "
            "rest do not; an editing run needs an image on every line, a text-to-image run on none"
        )
    return records


def _line_records(path: Path, text: str) -> list[PromptRecord]:
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        records.append(_jsonl_record(path, lineno, line) if path.suffix == ".jsonl" else PromptRecord(line))
    return records


def _csv_records(path: Path, text: str) -> list[PromptRecord]:
    reader = csv.DictReader(io.StringIO(text))
    column = next(
        (c for c in ("Prompts", "prompt", "Prompt", "prompts") if c in (reader.fieldnames or [])), None
    )
    if column is None:
        raise PromptFileError(
            f"prompt file '{path}': a .csv needs a 'Prompts' or 'prompt' column, found {reader.fieldnames}"
        )
    return [
        PromptRecord(row[column].strip(), group=row.get("Category"), metadata=dict(row))
        for row in reader
        if (row.get(column) or "").strip()
    ]


def _json_records(path: Path, text: str) -> list[PromptRecord]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PromptFileError(f"{path}: invalid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
        raise PromptFileError(f"prompt file '{path}': a .json prompt file is a list of strings")
    return [PromptRecord(p.strip(), group=path.stem) for p in data if p.strip()]


def _jsonl_record(path: Path, lineno: int, line: str) -> PromptRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise PromptFileError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
        raise PromptFileError(f"{path}:{lineno}: expected an object with a string 'prompt' field")
    tag = obj.get("tag")
    group = tag if isinstance(tag, str) else None
    image = obj.get("image")
    if image is None:
        return PromptRecord(obj["prompt"], group=group, metadata=obj)
    if not isinstance(image, str) or not image:
        raise PromptFileError(f"{path}:{lineno}: 'image' must be a file path string, got {image!r}")
    image_path = Path(image).expanduser()
    image_path = image_path if image_path.is_absolute() else path.parent / image_path
    if not image_path.is_file():
        raise PromptFileError(
            f"{path}:{lineno}: input image '{image}' does not exist (looked for {image_path}); "
            "image paths are relative to the prompt file's folder"
        )
    return PromptRecord(obj["prompt"], image_path.resolve(), group, obj)


@dataclass(frozen=True)
class Paraphrase:
    """One line of a paraphrase file: ``rendered``, the text the model is conditioned on,
    and ``judged``, the original prompt the rewards score its image against (with the
    original's metadata and input image, as :attr:`PromptRecord.prompt` gives them)."""

    judged: str
    rendered: str
    style: str | None = None  # the line's ``style`` field (how it was paraphrased), if any
    group: str | None = None  # the original's group (GenEval's ``tag``), as PromptRecord has it


# the fields of a paraphrase line that describe the paraphrase, not the original prompt
_PARAPHRASE_FIELDS = ("prompt", "original", "style")


def read_paraphrases(source: str | Path) -> list[Paraphrase]:
    """The lines of a paraphrase file: a ``.jsonl`` whose lines give the paraphrase as
    ``prompt``, the prompt it rephrases as ``original`` and optionally ``style``; any other
    field (GenEval's ``tag`` / ``include``, an ``image``) belongs to the original and is
    what rewards read (docs/DATA.md, "Paraphrase files")."""
    records = read_prompts(source)
    path = resolve_prompt_path(source)
    out = []
    for number, record in enumerate(records, 1):
        original = record.metadata.get("original")
        if not isinstance(original, str) or not original.strip():
            raise PromptFileError(
                f"paraphrase file '{path}': prompt {number} ('{record.text}') has no string 'original' "
                'field; each line reads {"prompt": "the paraphrase", "original": "the prompt it rephrases"}'
            )
        fields = {k: v for k, v in record.metadata.items() if k not in _PARAPHRASE_FIELDS}
        judged = PromptRecord(
            original.strip(), record.image, record.group, {"prompt": original.strip(), **fields}
        )
        rendered = PromptRecord(record.text, record.image)
        style = record.metadata.get("style")
        out.append(
            Paraphrase(
                judged.prompt, rendered.prompt, style if isinstance(style, str) else None, record.group
            )
        )
    return out


def spaced_subset(prompts: list[str], count: int) -> list[str]:
    """``count`` prompts evenly spaced through ``prompts`` (all when count >= len): a fixed
    subset that covers a file sorted by prompt type as well as a shuffled one."""
    if count >= len(prompts):
        return list(prompts)
    return [prompts[i] for i in spaced_positions(len(prompts), count)]


def spaced_positions(n: int, count: int) -> list[int]:
    """``count`` (< n) positions evenly spaced through ``range(n)``, the first included."""
    return [(i * n) // count for i in range(count)]


def check_image_column(prompts: list[str], path, family: str, edits_images: bool) -> None:
    """An editing family (``edits_images``, its adapter's ``FlowAdapter.edits_images``)
    needs an input image on every prompt, and a text-to-image family would silently ignore
    them: refuse both, naming ``family`` and the file ``path``."""
    if not prompts:  # no evaluation
        return
    with_image = isinstance(prompts[0], EditPrompt)
    if edits_images and not with_image:
        raise PromptFileError(
            f"model family '{family}' edits images, but prompt file '{path}' has no 'image' column; "
            'use a .jsonl file with lines like {"prompt": "make the red circle blue", "image": "in/0.png"}'
        )
    if with_image and not edits_images:
        raise PromptFileError(
            f"prompt file '{path}' gives input images, but model family '{family}' generates from text "
            "only and would ignore them; use an editing family (flux_kontext, qwenimage_edit) or a "
            "file without 'image'"
        )


def holdout_split(prompts: list, count: int, source) -> tuple[list, list]:
    """(training, held-out): ``count`` prompts evenly spaced through ``prompts`` (the same
    positions as :func:`spaced_subset`) held out of training for evaluation
    (``data.eval_holdout``). Refused when nothing would be left to train on."""
    if count >= len(prompts):
        raise PromptFileError(
            f"data.eval_holdout is {count} but data.train_prompts '{source}' holds {len(prompts)} prompts: "
            f"hold out fewer than {len(prompts)}, or set data.eval_prompts and data.eval_holdout=0"
        )
    held = spaced_positions(len(prompts), count)
    held_set = set(held)
    return [p for i, p in enumerate(prompts) if i not in held_set], [prompts[i] for i in held]


def prompt_keys(cfg) -> list[str]:
    """The ``data`` keys whose prompt files a run reads: the training file, and the
    evaluation file when the run evaluates and does not hold its prompts out of training."""
    evaluates = bool(cfg.eval.every or cfg.eval.at_start)
    return ["train_prompts"] + (["eval_prompts"] if evaluates and not cfg.data.eval_holdout else [])
