"""The ShapeWorld grammar: parsing, the fixed split, and the shipped prompt files."""

import itertools
from pathlib import Path

import pytest

from diffrl.data.prompts import load_prompts
from rewards.shapeworld import grammar

ASSETS = Path(__file__).resolve().parents[3] / "assets" / "shapeworld"


def test_every_generated_caption_parses_back_to_its_spec():
    specs = grammar.all_specs()
    assert len(specs) == 4 * 18 + 18 * 17 * 5  # counts + ordered pairs x (and + 4 relations)
    for spec in specs:
        assert grammar.parse(spec.caption()) == spec


def test_parse_examples_from_the_issue():
    s = grammar.parse("two red circles")
    assert s == grammar.Spec("count", (grammar.Group(2, "red", "circle"),))
    s = grammar.parse("A blue square to the left of a yellow triangle.")
    assert s.kind == "relation" and s.relation == "to the left of"
    assert [g.thing for g in s.groups] == [("blue", "square"), ("yellow", "triangle")]
    assert s.clauses() == [
        "exactly a blue square",
        "exactly a yellow triangle",
        "a blue square to the left of a yellow triangle",
    ]


@pytest.mark.parametrize(
    "prompt, why",
    [
        ("a photo of a cat", "outside the grammar"),
        ("two red circle", "wrong plural"),
        ("a red circles", "wrong plural"),
        ("five red circles", "outside the grammar"),
        ("a pink circle", "outside the grammar"),
        ("a red circle above a red circle", "must differ"),
        ("two red circles and a blue square", "one object each"),
        ("", "outside the grammar"),
    ],
)
def test_malformed_prompts_raise_one_clear_error(prompt, why):
    with pytest.raises(grammar.PromptGrammarError) as err:
        grammar.parse(prompt)
    assert why in str(err.value) and "ShapeWorld prompts look like" in str(err.value)


def test_split_is_disjoint_and_holds_out_combinations_never_seen_in_training():
    train, heldout = grammar.split()
    assert not set(train) & set(heldout)
    assert len(train) + len(heldout) == len(grammar.all_specs())
    held_counts, held_pairs = grammar.heldout_combinations()
    train_specs = [grammar.parse(p) for p in train]
    seen_pairs = {frozenset(g.thing for g in s.groups) for s in train_specs if s.kind != "count"}
    seen_counts = {(s.groups[0].count, *s.groups[0].thing) for s in train_specs if s.kind == "count"}
    assert held_pairs and not held_pairs & seen_pairs  # those two objects never co-occur in training
    assert held_counts and not held_counts & seen_counts
    for p in heldout:
        spec = grammar.parse(p)
        assert grammar.is_heldout(spec, held_counts, held_pairs)
        # every single object of a held-out prompt was seen in training (compositional, not novel words)
        assert all(any(g.thing in [h.thing for h in t.groups] for t in train_specs) for g in spec.groups)


def test_lists_interleave_kinds_so_any_prefix_is_balanced():
    _, heldout = grammar.split()
    kinds = [grammar.parse(p).kind for p in heldout[:30]]
    assert {k: kinds.count(k) for k in grammar.KINDS} == {"count": 10, "pair": 10, "relation": 10}


def test_shipped_prompt_files_equal_the_split(tmp_path):
    train, heldout = grammar.split()
    assert load_prompts(ASSETS / "train.txt") == train
    assert load_prompts(ASSETS / "heldout.txt") == heldout
    grammar.write_prompt_files(tmp_path)
    for name in ("train.txt", "heldout.txt"):
        assert (tmp_path / name).read_text() == (ASSETS / name).read_text()


def test_heldout_pairs_cover_about_a_fifth_of_object_pairs():
    _, held_pairs = grammar.heldout_combinations()
    total = len(list(itertools.combinations(grammar.THINGS, 2)))
    assert len(held_pairs) == round(0.2 * total)
