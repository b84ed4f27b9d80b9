"""The ShapeWorld prompt grammar: generate captions, parse them back, split train/held-out.

Three prompt kinds, each a small set of GenEval-style clauses::

    count     "{n} {colour} {shape}[s]"                 n in a|two|three|four
    pair      "a {colour} {shape} and a {colour} {shape}"
    relation  "a {colour} {shape} {relation} a {colour} {shape}"
              relation in "to the left of" | "to the right of" | "above" | "below"

Every object group is a clause "exactly n objects of this colour and shape" (``a``
means exactly one); a relation adds one clause between the two groups.

The late-step world (``toy_late_*`` configs) puts a texture word before the colour,
"a striped red square and a solid blue circle": striped objects alternate the colour with a
lighter tint row by row, solid ones are filled with the mean of the two, so the texture
changes no low-frequency content and only the last denoising steps can settle it. Each
textured group's clause then also asks for its texture.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

COLOURS = ("red", "green", "blue", "yellow", "purple", "cyan")
SHAPES = ("circle", "square", "triangle")
NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4}
COUNT_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
RELATIONS = ("to the left of", "to the right of", "above", "below")
TEXTURES = ("striped", "solid")
KINDS = ("count", "pair", "relation")


class PromptGrammarError(ValueError):
    """A prompt is outside the ShapeWorld grammar."""


@dataclass(frozen=True)
class Group:
    """``count`` objects of one colour and shape (and ``texture``, in the late world)."""

    count: int
    colour: str
    shape: str
    texture: str | None = None

    @property
    def thing(self) -> tuple[str, str]:
        return (self.colour, self.shape)

    def text(self) -> str:
        plural = "s" if self.count > 1 else ""
        texture = f"{self.texture} " if self.texture else ""
        return f"{COUNT_WORDS[self.count]} {texture}{self.colour} {self.shape}{plural}"


@dataclass(frozen=True)
class Spec:
    """What a prompt asks for: one or two groups and, for ``relation``, how group 0
    sits relative to group 1."""

    kind: str
    groups: tuple[Group, ...]
    relation: str | None = None

    def caption(self) -> str:
        if self.kind == "count":
            return self.groups[0].text()
        joiner = "and" if self.kind == "pair" else self.relation
        return f"{self.groups[0].text()} {joiner} {self.groups[1].text()}"

    def clauses(self) -> list[str]:
        out = [f"exactly {g.text()}" for g in self.groups]
        if self.relation:
            out.append(f"{self.groups[0].text()} {self.relation} {self.groups[1].text()}")
        return out


_GROUP = (
    rf"(a|an|one|two|three|four) (?:({'|'.join(TEXTURES)}) )?({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})(s?)"
)
_COUNT_RE = re.compile(rf"^{_GROUP}$")
_TWO_RE = re.compile(rf"^{_GROUP} (and|{'|'.join(RELATIONS)}) {_GROUP}$")
GRAMMAR_HELP = (
    "ShapeWorld prompts look like 'two red circles', 'a blue square and a cyan triangle' or "
    "'a blue square to the left of a yellow triangle' (counts a|two|three|four; colours "
    f"{'|'.join(COLOURS)}; shapes {'|'.join(SHAPES)}; relations {' | '.join(RELATIONS)}; an optional "
    f"texture {'|'.join(TEXTURES)} before the colour)"
)


def _group(number: str, texture: str | None, colour: str, shape: str, plural: str, prompt: str) -> Group:
    count = NUMBERS[number]
    if (count > 1) != bool(plural):
        raise PromptGrammarError(
            f"prompt '{prompt}': '{number} {shape}{plural}' has the wrong plural. {GRAMMAR_HELP}"
        )
    return Group(count, colour, shape, texture)


def parse(prompt: str) -> Spec:
    """The :class:`Spec` of ``prompt``; case, surrounding spaces and a final '.' are ignored."""
    text = " ".join(prompt.lower().strip().rstrip(".").split())
    if m := _COUNT_RE.match(text):
        return Spec("count", (_group(*m.groups(), prompt),))
    if m := _TWO_RE.match(text):
        g = m.groups()
        first, second = _group(*g[0:5], prompt), _group(*g[6:11], prompt)
        if first.count != 1 or second.count != 1:
            raise PromptGrammarError(
                f"prompt '{prompt}': two-object prompts take one object each. {GRAMMAR_HELP}"
            )
        if (first.texture is None) != (second.texture is None):
            raise PromptGrammarError(
                f"prompt '{prompt}': give a texture to both objects or to neither. {GRAMMAR_HELP}"
            )
        if first.thing == second.thing:
            raise PromptGrammarError(f"prompt '{prompt}': the two objects must differ. {GRAMMAR_HELP}")
        kind, relation = ("pair", None) if g[5] == "and" else ("relation", g[5])
        return Spec(kind, (first, second), relation)
    raise PromptGrammarError(f"prompt '{prompt}' is outside the grammar. {GRAMMAR_HELP}")


# -- the fixed train / held-out split ------------------------------------------------------
THINGS = tuple(itertools.product(COLOURS, SHAPES))


def all_specs() -> list[Spec]:
    """Every prompt the grammar can produce (with 'a', never 'an'/'one')."""
    specs = [Spec("count", (Group(n, c, s),)) for n in COUNT_WORDS for c, s in THINGS]
    for a, b in itertools.permutations(THINGS, 2):
        ga, gb = Group(1, *a), Group(1, *b)
        specs.append(Spec("pair", (ga, gb)))
        specs += [Spec("relation", (ga, gb), r) for r in RELATIONS]
    return specs


def heldout_combinations(seed: int = 0, pair_fraction: float = 0.2):
    """The combinations that never appear in training.

    * one count per (colour, shape), rotating so each count is held out about equally;
    * ``pair_fraction`` of the unordered object pairs: such two objects never appear
      together in any training prompt (neither as 'and' nor in any relation).
    """
    held_counts = {(1 + i % 4, c, s) for i, (c, s) in enumerate(THINGS)}
    pairs = [frozenset(p) for p in itertools.combinations(THINGS, 2)]
    held_pairs = set(random.Random(seed).sample(pairs, round(pair_fraction * len(pairs))))
    return held_counts, held_pairs


def is_heldout(spec: Spec, held_counts, held_pairs) -> bool:
    if spec.kind == "count":
        g = spec.groups[0]
        return (g.count, g.colour, g.shape) in held_counts
    return frozenset(g.thing for g in spec.groups) in held_pairs


def split(seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held-out) captions, each shuffled and interleaved by kind (count, pair,
    relation, count, ...) so that any prefix of a list has a balanced mix of kinds."""
    held_counts, held_pairs = heldout_combinations(seed)
    buckets = {(h, k): [] for h in (False, True) for k in KINDS}
    for spec in all_specs():
        buckets[(is_heldout(spec, held_counts, held_pairs), spec.kind)].append(spec.caption())
    rnd = random.Random(seed + 1)
    out = []
    for heldout in (False, True):
        lists = [rnd.sample(buckets[(heldout, k)], len(buckets[(heldout, k)])) for k in KINDS]
        out.append([p for row in itertools.zip_longest(*lists) for p in row if p is not None])
    return out[0], out[1]


def write_prompt_files(directory, seed: int = 0) -> None:
    """Write ``train.txt`` and ``heldout.txt`` (the files shipped in assets/shapeworld)."""
    from pathlib import Path

    train, heldout = split(seed)
    header = (
        f"# ShapeWorld {{}} prompts: rewards.shapeworld.grammar.split(seed={seed}); regenerate with\n"
        '# python -c "from rewards.shapeworld.grammar import write_prompt_files; '
        "write_prompt_files('assets/shapeworld')\"\n"
    )
    for name, prompts in (("train", train), ("heldout", heldout)):
        text = header.format(name) + "".join(p + "\n" for p in prompts)
        (Path(directory) / f"{name}.txt").write_text(text)


# -- the late-step world ----------------------------------------------------------------------
def late_specs() -> list[Spec]:
    """The late-step world's prompts: one textured object, or two textured objects joined
    by 'and'. No counts or relations, which the first denoising steps decide: the
    reward is then decided where the textures are, at the end."""
    specs = [Spec("count", (Group(1, c, s, t),)) for c, s in THINGS for t in TEXTURES]
    for a, b in itertools.permutations(THINGS, 2):
        for ta, tb in itertools.product(TEXTURES, repeat=2):
            specs.append(Spec("pair", (Group(1, *a, ta), Group(1, *b, tb))))
    return specs


def late_split(seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held-out) captions of the late-step world: the object pairs that
    :func:`heldout_combinations` holds out, and a quarter of the single textured objects
    (one texture of every second colour-shape), never appear in training."""
    _, held_pairs = heldout_combinations(seed)
    held_single = {(c, s, TEXTURES[i % 2]) for i, (c, s) in enumerate(THINGS) if i % 2 == 0}
    out = ([], [])
    for spec in late_specs():
        if spec.kind == "count":
            g = spec.groups[0]
            held = (g.colour, g.shape, g.texture) in held_single
        else:
            held = frozenset(g.thing for g in spec.groups) in held_pairs
        out[held].append(spec.caption())
    rnd = random.Random(seed + 1)
    return rnd.sample(out[0], len(out[0])), rnd.sample(out[1], len(out[1]))


def write_late_prompt_files(directory, seed: int = 0) -> None:
    """Write the late-step world's ``train.txt`` and ``heldout.txt`` (assets/shapeworld_late)."""
    from pathlib import Path

    train, heldout = late_split(seed)
    header = (
        f"# ShapeWorld late-step world {{}} prompts: rewards.shapeworld.grammar.late_split(seed={seed});\n"
        '# python -c "from rewards.shapeworld.grammar import write_late_prompt_files; '
        "write_late_prompt_files('assets/shapeworld_late')\"\n"
    )
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name, prompts in (("train", train), ("heldout", heldout)):
        (Path(directory) / f"{name}.txt").write_text(header.format(name) + "".join(p + "\n" for p in prompts))
