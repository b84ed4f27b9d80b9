"""The ShapeWorld prompt grammar: generate captions, parse them back, split train/held-out.

Three prompt kinds, each a small set of GenEval-style clauses::

    count     "{n} {colour} {shape}[s]"                 n in a|two|three|four
    pair      "a {colour} {shape} and a {colour} {shape}"
    relation  "a {colour} {shape} {relation} a {colour} {shape}"
              relation in "to the left of" | "to the right of" | "above" | "below"

Every object group is a clause "exactly n objects of this colour and shape" (``a``
means exactly one); a relation adds one clause between the two groups.
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
KINDS = ("count", "pair", "relation")


class PromptGrammarError(ValueError):
    """A prompt is outside the ShapeWorld grammar."""


@dataclass(frozen=True)
class Group:
    """``count`` objects of one colour and shape."""

    count: int
    colour: str
    shape: str

    @property
    def thing(self) -> tuple[str, str]:
        return (self.colour, self.shape)

    def text(self) -> str:
        plural = "s" if self.count > 1 else ""
        return f"{COUNT_WORDS[self.count]} {self.colour} {self.shape}{plural}"


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


_GROUP = rf"(a|an|one|two|three|four) ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})(s?)"
_COUNT_RE = re.compile(rf"^{_GROUP}$")
_TWO_RE = re.compile(rf"^{_GROUP} (and|{'|'.join(RELATIONS)}) {_GROUP}$")
GRAMMAR_HELP = (
    "ShapeWorld prompts look like 'two red circles', 'a blue square and a cyan triangle' or "
    "'a blue square to the left of a yellow triangle' (counts a|two|three|four; colours "
    f"{'|'.join(COLOURS)}; shapes {'|'.join(SHAPES)}; relations {' | '.join(RELATIONS)})"
)


def _group(number: str, colour: str, shape: str, plural: str, prompt: str) -> Group:
    count = NUMBERS[number]
    if (count > 1) != bool(plural):
        raise PromptGrammarError(
            f"prompt '{prompt}': '{number} {shape}{plural}' has the wrong plural. {GRAMMAR_HELP}"
        )
    return Group(count, colour, shape)


def parse(prompt: str) -> Spec:
    """The :class:`Spec` of ``prompt``; case, surrounding spaces and a final '.' are ignored."""
    text = " ".join(prompt.lower().strip().rstrip(".").split())
    if m := _COUNT_RE.match(text):
        return Spec("count", (_group(*m.groups(), prompt),))
    if m := _TWO_RE.match(text):
        g = m.groups()
        first, second = _group(*g[0:4], prompt), _group(*g[5:9], prompt)
        if first.count != 1 or second.count != 1:
            raise PromptGrammarError(
                f"prompt '{prompt}': two-object prompts take one object each. {GRAMMAR_HELP}"
            )
        if first.thing == second.thing:
            raise PromptGrammarError(f"prompt '{prompt}': the two objects must differ. {GRAMMAR_HELP}")
        kind, relation = ("pair", None) if g[4] == "and" else ("relation", g[4])
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
