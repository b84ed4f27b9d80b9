"""ShapeWorld paraphrases: the same meaning as a grammar caption, phrased in ways the
training prompts never are, to measure prompt overfitting (PromptRL, "Prompt Matters in
RL for Flow-Based Image Generation", code G-U-N/UniRL: RL'd flow models "memorize
specific training formulations" and collapse on "semantically equivalent but
stylistically varied prompts").

A paraphrase is built from a caption's :class:`~rewards.shapeworld.grammar.Spec`, never
from its text, in one of five styles:

* ``synonyms``: other words for colours, shapes, counts and relations ("crimson",
  "disc", "a pair of", "on top of");
* ``word_order``: the scene told in another order ("above a blue square there is a red
  circle", "circles, two of them, red ones");
* ``clause``: a subordinate clause carries the relation or the count ("a red circle
  that sits above a blue square", "circles which are red, two of them");
* ``verbose``: the caption inside a longer description ("a simple picture showing ...
  on a plain white background");
* ``register``: an instruction in another register ("please draw ...", "i want ...").

Each style mixes in the synonyms with probability one half per word, so no style is the
grammar's caption with one word swapped. The verifier judges a paraphrase's image
against its *original* caption (the ``original`` field of each line of the paraphrase
file, see :func:`paraphrase_lines`), so a paraphrase never needs to parse.

Converse relations keep the meaning: "A above B" may become "B below A"; every
template that moves the objects says so in its own words (the tests translate every
paraphrase back, independently, and compare with the spec).
"""

from __future__ import annotations

import random

from rewards.shapeworld.grammar import Group, Spec, parse

STYLES = ("synonyms", "word_order", "clause", "verbose", "register")

COLOUR_SYNONYMS = {
    "red": ("crimson", "scarlet"),
    "green": ("emerald", "lime"),
    "blue": ("azure", "cobalt"),
    "yellow": ("golden", "lemon"),
    "purple": ("violet", "lilac"),
    "cyan": ("turquoise", "aqua"),
}
SHAPE_SYNONYMS = {
    "circle": ("disc", "dot"),
    "square": ("box", "block"),
    "triangle": ("wedge", "pyramid"),
}
# plural forms of the synonyms (the grammar's own shapes take an s)
PLURALS = {"box": "boxes"}
COUNT_SYNONYMS = {
    1: ("one", "a single"),
    2: ("a pair of", "2"),
    3: ("a trio of", "3"),
    4: ("a group of four", "4"),
}
# relation -> (other words for it, its converse)
RELATION_SYNONYMS = {
    "above": ("on top of", "over"),
    "below": ("under", "beneath"),
    "to the left of": ("left of", "on the left side of"),
    "to the right of": ("right of", "on the right side of"),
}
CONVERSE = {
    "above": "below",
    "below": "above",
    "to the left of": "to the right of",
    "to the right of": "to the left of",
}


class _Words:
    """Word choices for one paraphrase: each content word is swapped for a synonym with
    probability ``swap``."""

    def __init__(self, rng: random.Random, swap: float = 0.5):
        self.rng, self.swap = rng, swap

    def _pick(self, word: str, synonyms: tuple[str, ...]) -> str:
        return self.rng.choice(synonyms) if self.rng.random() < self.swap else word

    def colour(self, colour: str) -> str:
        return self._pick(colour, COLOUR_SYNONYMS[colour])

    def shape(self, shape: str, plural: bool) -> str:
        word = self._pick(shape, SHAPE_SYNONYMS[shape])
        return (PLURALS.get(word, word + "s")) if plural else word

    def count(self, n: int) -> str:
        return self._pick({1: "a", 2: "two", 3: "three", 4: "four"}[n], COUNT_SYNONYMS[n])

    def relation(self, relation: str) -> str:
        return self._pick(relation, RELATION_SYNONYMS[relation])

    def group(self, g: Group) -> str:
        return f"{self.count(g.count)} {self.colour(g.colour)} {self.shape(g.shape, g.count > 1)}"


def _two_objects(spec: Spec, words: _Words, rng: random.Random) -> tuple[str, str, str | None]:
    """(first, second, relation) with the relation possibly turned into its converse
    (the objects swapped), so "A above B" may read "B below A"."""
    a, b = spec.groups
    if spec.kind == "pair":
        if rng.random() < 0.5:
            a, b = b, a
        return words.group(a), words.group(b), None
    relation = spec.relation
    if rng.random() < 0.5:
        a, b, relation = b, a, CONVERSE[relation]
    return words.group(a), words.group(b), relation


def _synonyms(spec: Spec, rng: random.Random) -> str:
    words = _Words(rng, swap=1.0)  # every content word another word
    if spec.kind == "count":
        return words.group(spec.groups[0])
    first, second, relation = _two_objects(spec, words, rng)
    return f"{first} {'and' if relation is None else words.relation(relation)} {second}"


def _word_order(spec: Spec, rng: random.Random) -> str:
    words = _Words(rng)
    if spec.kind == "count":
        g = spec.groups[0]
        shape = words.shape(g.shape, g.count > 1)
        if g.count == 1:
            return f"{shape}: just one, {words.colour(g.colour)}"
        return f"{shape}, {words.count(g.count)} of them, {words.colour(g.colour)} ones"
    first, second, relation = _two_objects(spec, words, rng)
    if relation is None:
        return f"{second}, and also {first}"
    return f"{words.relation(relation)} {second} there is {first}"


def _clause(spec: Spec, rng: random.Random) -> str:
    words = _Words(rng)
    if spec.kind == "count":
        g = spec.groups[0]
        shape = words.shape(g.shape, g.count > 1)
        verb = "are" if g.count > 1 else "is"
        return f"{words.count(g.count)} {shape} which {verb} {words.colour(g.colour)}"
    first, second, relation = _two_objects(spec, words, rng)
    if relation is None:
        return f"{first}, which is next to {second}"
    return f"{first} that sits {words.relation(relation)} {second}"


def _verbose(spec: Spec, rng: random.Random) -> str:
    words = _Words(rng)
    frame = rng.choice(
        ("a simple picture showing {} on a plain white background", "an image in which we see {}")
    )
    if spec.kind == "count":
        return frame.format(words.group(spec.groups[0]))
    first, second, relation = _two_objects(spec, words, rng)
    middle = "together with" if relation is None else f"placed {words.relation(relation)}"
    return frame.format(f"{first} {middle} {second}")


def _register(spec: Spec, rng: random.Random) -> str:
    words = _Words(rng)
    ask = rng.choice(("please draw {}", "i want {}, thanks", "could you render {}?"))
    if spec.kind == "count":
        return ask.format(words.group(spec.groups[0]))
    first, second, relation = _two_objects(spec, words, rng)
    return ask.format(f"{first} {'plus' if relation is None else words.relation(relation)} {second}")


_MAKERS = {
    "synonyms": _synonyms,
    "word_order": _word_order,
    "clause": _clause,
    "verbose": _verbose,
    "register": _register,
}


def paraphrase(caption: str | Spec, style: str, rng: random.Random) -> str:
    """A paraphrase of ``caption`` (a grammar caption or its spec) in ``style``.
    Textured captions (the late-step world) are not paraphrased."""
    if style not in _MAKERS:
        raise ValueError(f"unknown paraphrase style '{style}'; choose from {', '.join(STYLES)}")
    spec = parse(caption) if isinstance(caption, str) else caption
    if any(g.texture for g in spec.groups):
        raise ValueError("the late-step world's textured captions have no paraphrase grammar")
    return _MAKERS[style](spec, rng)


def paraphrase_lines(captions: list[str], seed: int = 0) -> list[dict]:
    """One paraphrase of every caption, the styles in turn (caption i in style i mod 5),
    as the lines of a paraphrase file: ``{"prompt": paraphrase, "original": caption,
    "style": style}`` (docs/DATA.md, "Paraphrase files")."""
    rng = random.Random(seed)
    return [
        {
            "prompt": paraphrase(c, STYLES[i % len(STYLES)], rng),
            "original": c,
            "style": STYLES[i % len(STYLES)],
        }
        for i, c in enumerate(captions)
    ]


def write_paraphrase_file(path, captions: list[str], seed: int = 0) -> None:
    """Write :func:`paraphrase_lines` as a ``.jsonl`` (the shipped
    ``assets/shapeworld/heldout_paraphrases.jsonl``: the held-out captions, seed 0)."""
    import json
    from pathlib import Path

    header = (
        f"# ShapeWorld paraphrases: rewards.shapeworld.paraphrase.paraphrase_lines(captions, seed={seed});\n"
        "# the images of a line's prompt are judged against its original. Regenerate the shipped file with\n"
        '# python -c "from rewards.shapeworld import grammar, paraphrase as p; '
        "p.write_paraphrase_file('assets/shapeworld/heldout_paraphrases.jsonl', grammar.split(0)[1])\"\n"
    )
    lines = paraphrase_lines(captions, seed)
    Path(path).write_text(header + "".join(json.dumps(line) + "\n" for line in lines))
