"""ShapeWorld editing: instructions that change one object of a rendered scene, and the
verifier that checks the edit from pixels.

Three instruction kinds, each about one object of a two-object source scene::

    recolour  "make the {colour} {shape} {new colour}"
    reshape   "turn the {colour} {shape} into a {new shape}"
    remove    "remove the {colour} {shape}"

An edit is right when three clauses hold (GenEval-style, as :mod:`verifier`): **edit**,
the named object changed as asked *where it was* (or is gone, for ``remove``); **keep**,
every other object is still there, unchanged, where it was; **nothing else**, no object
was added. Positions are compared as fractions of the image side, so a source drawn at
32 px checks an edit generated at any size. The source objects come from detecting the
source image with the same detector (:func:`verifier.detect`), so the verifier needs
nothing but the two images and the instruction.

The shipped task (``assets/shapeworld/edit``) edits the pair scenes of the text-to-image
split: a scene whose object pair is held out there (:func:`grammar.heldout_combinations`)
is a held-out edit here.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from rewards.images import to_tensor_batch
from rewards.prompts import EditPrompt, load_image
from rewards.shapeworld import grammar
from rewards.shapeworld.fidelity import fidelity
from rewards.shapeworld.verifier import Detection, detect

EDIT_KINDS = ("recolour", "reshape", "remove")
_C, _S = "|".join(grammar.COLOURS), "|".join(grammar.SHAPES)
_PATTERNS = {
    "recolour": re.compile(rf"^make the ({_C}) ({_S}) ({_C})$"),
    "reshape": re.compile(rf"^turn the ({_C}) ({_S}) into an? ({_S})$"),
    "remove": re.compile(rf"^remove the ({_C}) ({_S})$"),
}
EDIT_HELP = (
    "ShapeWorld edits look like 'make the red circle blue', 'turn the red circle into a square' "
    f"or 'remove the red circle' (colours {_C}; shapes {_S})"
)


class EditGrammarError(ValueError):
    """An instruction is outside the editing grammar, or does not fit its source image."""


@dataclass(frozen=True)
class Edit:
    """What an instruction asks: change ``target`` (colour, shape) into ``result`` (None: remove)."""

    kind: str
    target: tuple[str, str]
    result: tuple[str, str] | None

    def instruction(self) -> str:
        colour, shape = self.target
        if self.kind == "recolour":
            return f"make the {colour} {shape} {self.result[0]}"
        if self.kind == "reshape":
            return f"turn the {colour} {shape} into a {self.result[1]}"
        return f"remove the {colour} {shape}"


def parse_edit(instruction: str) -> Edit:
    text = " ".join(str(instruction).lower().strip().rstrip(".").split())
    for kind, pattern in _PATTERNS.items():
        if m := pattern.match(text):
            colour, shape = m.group(1), m.group(2)
            if kind == "recolour":
                result = (m.group(3), shape)
            elif kind == "reshape":
                result = (colour, m.group(3))
            else:
                result = None
            if result == (colour, shape):
                raise EditGrammarError(f"edit '{instruction}' changes nothing. {EDIT_HELP}")
            return Edit(kind, (colour, shape), result)
    raise EditGrammarError(f"edit '{instruction}' is outside the editing grammar. {EDIT_HELP}")


@dataclass
class EditVerdict:
    """Scores of one edited image, with each clause."""

    prompt: str
    strict: float
    partial: float
    clauses: list[dict]
    kind: str = ""
    reason: str = ""


def _normalised(dets: list[Detection], height: int, width: int) -> list[tuple[str, str, float, float]]:
    return [(d.colour, d.shape, d.cx / width, d.cy / height) for d in dets]


def _near(a, b, tolerance: float) -> bool:
    return abs(a[2] - b[2]) <= tolerance and abs(a[3] - b[3]) <= tolerance


def expected_scene(edit: Edit, source) -> list[tuple[str, str, float, float]]:
    """The source objects with the edit applied; raises if the source does not hold
    exactly one object the instruction names."""
    named = [o for o in source if o[:2] == edit.target]
    if len(named) != 1:
        raise EditGrammarError(
            f"edit '{edit.instruction()}': the source image has {len(named)} "
            f"{' '.join(edit.target)}s, not one"
        )
    out = [o for o in source if o is not named[0]]
    if edit.result is not None:
        out.insert(0, (*edit.result, *named[0][2:]))
    return out


def verify_edit(edit: Edit, source, edited, tolerance: float = 0.15) -> tuple[list[dict], int]:
    """Clauses (edit, keep, nothing else) of ``edited`` against ``source`` (normalised objects)."""
    expected = expected_scene(edit, source)
    changed = [o for o in source if o[:2] == edit.target][0]
    if edit.result is None:
        ok_edit = not any(o[:2] == edit.target and _near(o, changed, tolerance) for o in edited)
    else:
        ok_edit = sum(o[:2] == edit.result and _near(o, changed, tolerance) for o in edited) == 1
    kept = expected[1:] if edit.result is not None else expected
    ok_keep = all(any(o[:2] == k[:2] and _near(o, k, tolerance) for o in edited) for k in kept)
    return [
        {"clause": "edit", "ok": ok_edit},
        {"clause": "keep", "ok": ok_keep},
        {"clause": "nothing else", "ok": len(edited) == len(expected), "found": len(edited)},
    ], len(expected)


class ShapeWorldEditVerifier:
    """Registered as ``shapeworld_edit``: scores edited images against their
    :class:`~rewards.prompts.EditPrompt` (instruction + source image). ``score``:
    ``partial`` (fraction of the three clauses, the default), ``strict`` or ``mean``.
    Logs ``shapeworld_edit_strict`` / ``_partial``, strict accuracy per edit kind
    (``shapeworld_edit_kind/<kind>``, NaN where a sample is of another kind) and the
    fidelity measures of the edited image."""

    name = "shapeworld_edit"

    def __init__(
        self, score: str = "partial", tolerance: float = 0.15, fg_threshold: float = 0.3, min_area: int = 10
    ):
        if score not in ("partial", "strict", "mean"):
            raise ValueError(f"shapeworld_edit: score must be 'partial', 'strict' or 'mean', got '{score}'")
        self.score, self.tolerance = score, float(tolerance)
        self.fg_threshold, self.min_area = fg_threshold, min_area
        self._sources: dict[str, list] = {}

    def _source(self, path: str):
        if path not in self._sources:
            image = load_image(path)
            dets = detect(image[None], self.fg_threshold, self.min_area)[0]
            self._sources[path] = _normalised(dets, *image.shape[1:])
        return self._sources[path]

    @classmethod
    def prompt_checker(cls, **args):
        """The prompt check for ``--dry-run`` and ``--preflight``: this reward has no weights,
        so it is built and asked."""
        return cls(**args).check_prompts

    def check_prompts(self, prompts: list[str]) -> None:
        """One :class:`EditGrammarError` naming every prompt that has no image, is outside
        the grammar, or does not fit its source image."""
        bad = []
        for p in prompts:
            try:
                if not isinstance(p, EditPrompt):
                    raise EditGrammarError("no input image")
                expected_scene(parse_edit(p), self._source(p.image))
            except EditGrammarError as err:
                bad.append(f"{str(p)!r} ({err})" if "no input" in str(err) else str(err))
        if bad:
            shown = "; ".join(bad[:3]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")
            raise EditGrammarError(
                f"shapeworld_edit reward: {len(bad)} prompt(s) cannot be checked: {shown}. Prompts need an "
                f"'image' column (.jsonl). {EDIT_HELP}"
            )

    def verdict(self, prompt: str, detections: list[Detection], height: int, width: int) -> EditVerdict:
        try:
            if not isinstance(prompt, EditPrompt):
                raise EditGrammarError("the prompt has no input image")
            edit = parse_edit(prompt)
            clauses, _ = verify_edit(
                edit, self._source(prompt.image), _normalised(detections, height, width), self.tolerance
            )
        except EditGrammarError as err:  # scored 0 with the reason, never raised mid-run
            return EditVerdict(str(prompt), 0.0, 0.0, [], reason=str(err))
        satisfied = sum(c["ok"] for c in clauses)
        return EditVerdict(
            str(prompt), float(satisfied == len(clauses)), satisfied / len(clauses), clauses, edit.kind
        )

    def __call__(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        images = to_tensor_batch(images).float()
        if len(prompts) != images.shape[0]:
            raise ValueError(f"shapeworld_edit: {images.shape[0]} images but {len(prompts)} prompts")
        dets = detect(images, self.fg_threshold, self.min_area)
        verdicts = [self.verdict(p, d, *images.shape[-2:]) for p, d in zip(prompts, dets)]
        if isinstance(metadata, dict):
            metadata[self.name] = verdicts
        strict = torch.tensor([v.strict for v in verdicts])
        partial = torch.tensor([v.partial for v in verdicts])
        score = {"partial": partial, "strict": strict, "mean": (strict + partial) / 2}[self.score]
        kinds = {
            f"shapeworld_edit_kind/{k}": torch.tensor(
                [v.strict if v.kind == k else float("nan") for v in verdicts]
            )
            for k in EDIT_KINDS
        }
        damage = {k: v.cpu() for k, v in fidelity(images, self.fg_threshold).items()}
        return {
            self.name: score,
            "shapeworld_edit_strict": strict,
            "shapeworld_edit_partial": partial,
            **kinds,
            **damage,
        }


# -- the shipped task ---------------------------------------------------------------------
def _edit_for(spec: grammar.Spec, rnd: random.Random) -> Edit:
    """A random edit of one of the pair's two objects that keeps the two objects distinct."""
    i = rnd.randrange(2)
    target, other = spec.groups[i].thing, spec.groups[1 - i].thing
    kind = EDIT_KINDS[rnd.randrange(3)]
    if kind == "remove":
        return Edit(kind, target, None)
    if kind == "recolour":
        choices = [(c, target[1]) for c in grammar.COLOURS if (c, target[1]) not in (target, other)]
    else:
        choices = [(target[0], s) for s in grammar.SHAPES if (target[0], s) not in (target, other)]
    return Edit(kind, target, rnd.choice(choices))


def edit_examples(seed: int = 0) -> tuple[list[tuple[str, grammar.Spec]], list[tuple[str, grammar.Spec]]]:
    """(train, held-out) lists of (instruction, source spec): one edit per pair scene,
    split by the text-to-image held-out object pairs."""
    _, held_pairs = grammar.heldout_combinations(seed)
    rnd = random.Random(seed + 2)
    train, heldout = [], []
    for spec in grammar.all_specs():
        if spec.kind != "pair":
            continue
        edit = _edit_for(spec, rnd)
        held = frozenset(g.thing for g in spec.groups) in held_pairs
        (heldout if held else train).append((edit.instruction(), spec))
    return train, heldout


def write_edit_files(directory, seed: int = 0, resolution: int = 32) -> None:
    """``train.jsonl`` and ``heldout.jsonl`` with their source images in ``images/`` (the
    files shipped in assets/shapeworld/edit). Each source is rendered until the detector
    finds exactly its two objects, so every shipped edit can be checked."""
    from PIL import Image

    from rewards.shapeworld.render import render

    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    checker = ShapeWorldEditVerifier()
    for split, examples in zip(("train", "heldout"), edit_examples(seed)):
        lines = []
        for k, (instruction, spec) in enumerate(examples):
            rnd = random.Random(f"{seed}-{split}-{k}")
            while True:
                pixels = render(spec, rnd, resolution)
                found = detect(torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 255)[0]
                if sorted((d.colour, d.shape) for d in found) == sorted(g.thing for g in spec.groups):
                    break
            name = f"images/{split}_{k:03d}.png"
            Image.fromarray(pixels).save(directory / name, optimize=True)
            checker.check_prompts([EditPrompt(instruction, directory / name)])
            lines.append(json.dumps({"prompt": instruction, "image": name, "source": spec.caption()}))
        header = (
            f"# ShapeWorld {split} edits: rewards.shapeworld.editing.write_edit_files(seed={seed});\n"
            "# regenerate with\n"
            '# python -c "from rewards.shapeworld.editing import write_edit_files; '
            "write_edit_files('assets/shapeworld/edit')\"\n"
        )
        (directory / f"{split}.jsonl").write_text(header + "\n".join(lines) + "\n")
