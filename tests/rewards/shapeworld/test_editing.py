"""ShapeWorld editing: the instruction grammar, the shipped task, and the edit verifier
checked against scenes drawn by the renderer (an independent code path: the verifier
only sees pixels)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from diffrl.data.prompts import load_prompts
from rewards import build
from rewards.prompts import EditPrompt
from rewards.shapeworld import grammar
from rewards.shapeworld.editing import (
    EDIT_KINDS,
    Edit,
    EditGrammarError,
    ShapeWorldEditVerifier,
    edit_examples,
    parse_edit,
)
from rewards.shapeworld.render import draw, layout

EDIT_DIR = Path(__file__).resolve().parents[3] / "assets" / "shapeworld" / "edit"


def test_instructions_round_trip_and_bad_ones_are_named():
    for edit in (
        Edit("recolour", ("red", "circle"), ("blue", "circle")),
        Edit("reshape", ("red", "circle"), ("red", "square")),
        Edit("remove", ("green", "triangle"), None),
    ):
        assert parse_edit(edit.instruction()) == edit
    assert parse_edit("Make the red circle blue.").result == ("blue", "circle")
    with pytest.raises(EditGrammarError, match="changes nothing"):
        parse_edit("make the red circle red")
    with pytest.raises(EditGrammarError, match="outside the editing grammar"):
        parse_edit("paint everything pink")


def test_shipped_edit_files_are_the_generator_output_and_all_checkable():
    train_examples, held_examples = edit_examples(seed=0)
    for split, examples in (("train", train_examples), ("heldout", held_examples)):
        prompts = load_prompts(EDIT_DIR / f"{split}.jsonl")
        assert [str(p) for p in prompts] == [instruction for instruction, _ in examples]
        assert all(isinstance(p, EditPrompt) and Path(p.image).is_file() for p in prompts)
        ShapeWorldEditVerifier().check_prompts(prompts)  # raises on any it cannot check
    # the held-out edits are exactly the scenes whose object pair the T2I split holds out
    _, held_pairs = grammar.heldout_combinations(0)
    assert all(frozenset(g.thing for g in spec.groups) in held_pairs for _, spec in held_examples)
    assert not any(frozenset(g.thing for g in spec.groups) in held_pairs for _, spec in train_examples)
    assert {parse_edit(i).kind for i, _ in train_examples} == set(EDIT_KINDS)


def _scene(tmp_path, seed: int):
    """A source pair scene (two objects, drawn by the renderer) saved as PNG."""
    spec = grammar.parse("a red circle and a green square")
    objects = layout(spec, random.Random(seed), 32)
    path = tmp_path / f"src{seed}.png"
    Image.fromarray(draw(objects, 32)).save(path)
    return objects, path


def _image(objects, size: int = 32) -> torch.Tensor:
    return torch.from_numpy(draw(objects, size)).permute(2, 0, 1).float()[None] / 255


def _scaled(objects, factor: int):
    return [replace(o, x=o.x * factor, y=o.y * factor, size=o.size * factor) for o in objects]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_verifier_accepts_right_edits_and_names_the_clause_a_wrong_one_breaks(tmp_path, seed):
    (circle, square), path = _scene(tmp_path, seed)
    verifier = build("shapeworld_edit")
    cases = {
        # instruction, objects drawn as the edited image, clauses expected to hold
        "right recolour": ("make the red circle blue", [replace(circle, colour="blue"), square], (1, 1, 1)),
        "right reshape": (
            "turn the red circle into a triangle",
            [replace(circle, shape="triangle"), square],
            (1, 1, 1),
        ),
        "right removal": ("remove the red circle", [square], (1, 1, 1)),
        "unchanged": ("make the red circle blue", [circle, square], (0, 1, 1)),
        "other object lost": ("make the red circle blue", [replace(circle, colour="blue")], (1, 0, 0)),
        "other object changed": (
            "make the red circle blue",
            [replace(circle, colour="blue"), replace(square, colour="yellow")],
            (1, 0, 1),
        ),
        "nothing removed": ("remove the red circle", [circle, square], (0, 1, 0)),
    }
    for name, (instruction, objects, expected) in cases.items():
        meta = {}
        out = verifier(_image(objects), [EditPrompt(instruction, path)], meta)
        clauses = tuple(int(c["ok"]) for c in meta["shapeworld_edit"][0].clauses)
        assert clauses == expected, name
        assert out["shapeworld_edit_strict"].item() == float(all(expected)), name
        assert out["shapeworld_edit"].item() == pytest.approx(sum(expected) / 3), name
    # positions are fractions of the side: the same right edit generated at 64 px passes
    big = _image(_scaled([replace(circle, colour="blue"), square], 2), 64)
    assert (
        verifier(big, [EditPrompt("make the red circle blue", path)])["shapeworld_edit_strict"].item() == 1.0
    )


def test_an_edit_in_the_wrong_place_fails_the_edit_clause(tmp_path):
    (circle, square), path = _scene(tmp_path, 0)
    moved = replace(circle, colour="blue", x=(circle.x + 16) % 24, y=(circle.y + 16) % 24)
    meta = {}
    ShapeWorldEditVerifier()(_image([moved, square]), [EditPrompt("make the red circle blue", path)], meta)
    assert not meta["shapeworld_edit"][0].clauses[0]["ok"]


def test_prompts_without_images_or_that_do_not_fit_the_source_are_refused_up_front(tmp_path):
    _, path = _scene(tmp_path, 0)
    verifier = ShapeWorldEditVerifier()
    with pytest.raises(EditGrammarError, match="no input image"):
        verifier.check_prompts(["make the red circle blue"])
    with pytest.raises(EditGrammarError, match="has 0 blue triangles"):
        verifier.check_prompts([EditPrompt("remove the blue triangle", path)])
    # mid-run they score 0 with the reason, never raise
    meta = {}
    out = verifier(torch.ones(1, 3, 32, 32), ["make the red circle blue"], meta)
    assert out["shapeworld_edit"].item() == 0 and "no input image" in meta["shapeworld_edit"][0].reason
