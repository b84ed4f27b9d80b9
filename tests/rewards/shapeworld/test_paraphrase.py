"""ShapeWorld paraphrases keep their caption's meaning, are never a grammar caption, and
the shipped file is what the grammar writes."""

from __future__ import annotations

import json
import random
import re

import pytest

from rewards.shapeworld import grammar
from rewards.shapeworld.paraphrase import STYLES, paraphrase, paraphrase_lines, write_paraphrase_file

# the test's own reading of the paraphrase vocabulary: which words name which colour,
# shape, count and relation (written from the words' meanings, not from the module)
COLOUR = {
    "red": "red", "crimson": "red", "scarlet": "red", "green": "green", "emerald": "green", "lime": "green",
    "blue": "blue", "azure": "blue", "cobalt": "blue", "yellow": "yellow", "golden": "yellow",
    "lemon": "yellow", "purple": "purple", "violet": "purple", "lilac": "purple", "cyan": "cyan",
    "turquoise": "cyan", "aqua": "cyan",
}  # fmt: skip
SHAPE = {
    "circle": "circle", "disc": "circle", "dot": "circle", "square": "square", "box": "square",
    "block": "square", "triangle": "triangle", "wedge": "triangle", "pyramid": "triangle",
}  # fmt: skip
COUNTS = [("a group of four", 4), ("a trio of", 3), ("a pair of", 2), ("a single", 1), ("four", 4), ("4", 4),
          ("three", 3), ("3", 3), ("two", 2), ("2", 2), ("one", 1), ("just one", 1)]  # fmt: skip
RELATIONS = [("on the left side of", "to the left of"), ("on the right side of", "to the right of"),
             ("to the left of", "to the left of"), ("to the right of", "to the right of"),
             ("left of", "to the left of"), ("right of", "to the right of"), ("on top of", "above"),
             ("above", "above"), ("over", "above"), ("below", "below"), ("under", "below"),
             ("beneath", "below")]  # fmt: skip
OPPOSITE = {
    "above": "below",
    "below": "above",
    "to the left of": "to the right of",
    "to the right of": "to the left of",
}


def _singular(word: str) -> str:
    for plural, one in (("boxes", "box"),):
        if word == plural:
            return one
    return word[:-1] if word.endswith("s") and word[:-1] in SHAPE else word


def read_back(text: str) -> grammar.Spec:
    """The spec a paraphrase means, read independently of how it was made."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    colours = [COLOUR[w] for w in words if w in COLOUR]
    shapes = [SHAPE[_singular(w)] for w in words if _singular(w) in SHAPE]
    plural = any(w != _singular(w) for w in words if _singular(w) in SHAPE)
    assert len(colours) == len(shapes) and len(colours) in (1, 2), text
    if len(colours) == 1:
        joined = " ".join(words)
        count = next((n for phrase, n in COUNTS if re.search(rf"\b{phrase}\b", joined)), 1)
        assert (count > 1) == plural, text
        return grammar.Spec("count", (grammar.Group(count, colours[0], shapes[0]),))
    groups = tuple(grammar.Group(1, c, s) for c, s in zip(colours, shapes))
    joined = " ".join(words)
    found = next(((phrase, rel) for phrase, rel in RELATIONS if re.search(rf"\b{phrase}\b", joined)), None)
    if found is None:
        return grammar.Spec("pair", groups)
    phrase, relation = found
    if joined.startswith(phrase):  # "below X there is Y": Y is below X
        groups = groups[::-1]
    return grammar.Spec("relation", groups, relation)


def same_meaning(a: grammar.Spec, b: grammar.Spec) -> bool:
    if a.kind != b.kind:
        return False
    if a.kind == "pair":
        return set(a.groups) == set(b.groups)
    if a.kind == "relation" and a.groups != b.groups:  # the converse: B (opposite) A
        return a.groups == b.groups[::-1] and a.relation == OPPOSITE[b.relation]
    return a == b


@pytest.mark.parametrize("style", STYLES)
def test_every_paraphrase_means_its_caption_and_is_outside_the_training_grammar(style):
    rng = random.Random(5)
    captions = grammar.split(0)[0] + grammar.split(0)[1]
    for caption in captions:
        text = paraphrase(caption, style, rng)
        assert same_meaning(read_back(text), grammar.parse(caption)), (caption, text)
        with pytest.raises(grammar.PromptGrammarError):
            grammar.parse(text)


def test_styles_rotate_and_the_synonym_style_changes_every_content_word():
    captions = grammar.split(0)[1][:10]
    lines = paraphrase_lines(captions, seed=3)
    assert [line["style"] for line in lines] == [STYLES[i % 5] for i in range(10)]
    assert [line["original"] for line in lines] == captions
    rng = random.Random(0)
    for caption in captions:
        text = paraphrase(caption, "synonyms", rng)
        kept = set(re.findall(r"[a-z]+", text)) & (set(grammar.COLOURS) | set(grammar.SHAPES))
        assert not kept, (caption, text)


def test_the_shipped_paraphrase_file_is_what_the_grammar_writes(tmp_path):
    from diffrl.data.prompts import PROJECT_ROOT

    shipped = PROJECT_ROOT / "assets" / "shapeworld" / "heldout_paraphrases.jsonl"
    write_paraphrase_file(tmp_path / "p.jsonl", grammar.split(0)[1])
    assert (tmp_path / "p.jsonl").read_text() == shipped.read_text()
    lines = [json.loads(x) for x in shipped.read_text().splitlines() if not x.startswith("#")]
    assert [x["original"] for x in lines] == grammar.split(0)[1]


def test_textured_captions_and_unknown_styles_are_refused():
    with pytest.raises(ValueError, match="textured"):
        paraphrase("a striped red square", "synonyms", random.Random(0))
    with pytest.raises(ValueError, match="choose from"):
        paraphrase("a red square", "poetry", random.Random(0))
