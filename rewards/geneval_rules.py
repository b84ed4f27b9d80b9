"""GenEval's rules (Ghosh et al. 2023, "GenEval: An Object-Focused Framework for Evaluating
Text-to-Image Alignment", arXiv:2310.11513, Sec. 3), written once for every detector.

A task is GenEval's metadata: ``include`` requirements (a class, a count, optionally a
colour, optionally a position relative to an earlier group) joined by AND, and
``exclude`` requirements (fewer than ``count`` of a class) joined by OR. Detections are
per class, most confident first. Three rule sets read the same clauses:

* :data:`GENEVAL`: the benchmark (``evaluation/evaluate_images.py``): a group needs at
  least ``count`` detections; colour and position are judged on the ``count`` most
  confident ones; every object of a group must stand in the relation to every object of
  its target group; exclude clauses apply (counting prompts exclude ``count + 1``).
* :data:`FLOW_GRPO`: flow-GRPO's GenEval training reward (its reward server,
  yifan123/reward-server@92ac29fb, ``reward_server/gen_eval.py: evaluate_reward``, which
  flow_grpo's ``geneval_score`` optimises as ``score``): counts must be exact, and the
  partial score is the mean of per-clause credits ``1 - |count - found| / count``
  (negative when far too many objects are found, as there). When both groups of a
  position prompt pass and the relation fails, the reference appends 0.0 *and then* 1.0,
  so "a cat left of a dog" with the cat on the right scores 3/4, not 2/3; we reproduce it
  as an extra clause (``extra: True``, credit 1) because that is the number flow-GRPO
  trained on. :data:`FLOW_GRPO_PER_CLAUSE` drops it (one clause, one credit: 2/3), which
  we take to be what was meant.
* :data:`SHAPEWORLD`: the ShapeWorld verifier (:mod:`rewards.shapeworld.verifier`), the
  offline twin: exact counts of each (colour, shape) class, and a relation that holds when
  any pair of the two groups stands in it, judged whether or not the counts are right.

The relation geometry is a parameter: GenEval's box rule (:func:`relative_position`) or
ShapeWorld's centroid margin.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

POSITIONS = ("left of", "right of", "above", "below")


@dataclass(frozen=True)
class Requirement:
    """``count`` objects of ``cls`` (at least or exactly, by the rule set), optionally of
    ``colour``, optionally in ``position = (relation, index of the target include)``.
    ``label`` is how clauses name the group (``"a red circle"``); default "a dog" / "2 dogs"."""

    cls: str
    count: int
    colour: str | None = None
    position: tuple[str, int] | None = None
    label: str = ""

    def name(self) -> str:
        if self.label:
            return self.label
        return article(self.cls) if self.count == 1 else f"{self.count} {plural(self.cls)}"


@dataclass(frozen=True)
class Task:
    """One prompt's GenEval metadata (``tag`` as in GenEval: single_object, two_object,
    counting, colors, position, color_attr)."""

    prompt: str
    tag: str
    include: tuple[Requirement, ...]
    exclude: tuple[Requirement, ...] = ()

    @classmethod
    def from_metadata(cls, meta: dict) -> Task:
        """From a line of GenEval's ``evaluation_metadata.jsonl``."""

        def req(r: dict) -> Requirement:
            position = tuple(r["position"]) if r.get("position") else None
            return Requirement(r["class"], int(r["count"]), r.get("color"), position)

        include = tuple(req(r) for r in meta.get("include", []))
        exclude = tuple(req(r) for r in meta.get("exclude", []))
        return cls(meta.get("prompt", ""), meta.get("tag", ""), include, exclude)


@dataclass(frozen=True)
class Found:
    """One detection: ``box`` (x0, y0, x1, y1) in pixels, its confidence, its colour when the
    detector knows it (ShapeWorld; None leaves colour to a classifier), and its ``mask``, a
    (H, W) bool tensor over the whole image when the detector segments (Mask2Former in
    GenEval, the ShapeWorld twin here; OWLv2 gives boxes only)."""

    box: tuple[float, float, float, float]
    score: float = 1.0
    colour: str | None = None
    mask: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Rules:
    exact_counts: bool  # exactly ``count`` (flow-GRPO, ShapeWorld) or at least (GenEval)
    every_pair: bool  # relation between every pair of the two groups (GenEval) or any pair
    relation_needs_groups: bool  # relation judged only when both groups passed their clauses
    use_exclude: bool
    failed_relation_extra: bool = False  # flow-GRPO's extra 1.0 after a failed relation (see above)


GENEVAL = Rules(exact_counts=False, every_pair=True, relation_needs_groups=True, use_exclude=True)
FLOW_GRPO = replace(GENEVAL, exact_counts=True, use_exclude=False, failed_relation_extra=True)
FLOW_GRPO_PER_CLAUSE = replace(FLOW_GRPO, failed_relation_extra=False)
SHAPEWORLD = Rules(exact_counts=True, every_pair=False, relation_needs_groups=False, use_exclude=False)


@dataclass
class Judgement:
    """Clauses of one image: dicts with ``clause`` (text), ``ok``, ``credit`` and, for object
    groups, ``found``; flow-GRPO's extra credit is a clause with ``extra: True``. ``correct``
    is every clause holding."""

    clauses: list[dict] = field(default_factory=list)

    @property
    def correct(self) -> bool:
        return all(c["ok"] for c in self.clauses)

    @property
    def fraction(self) -> float:
        """Share of clauses that hold (ShapeWorld's ``partial``; extra credits aside)."""
        real = [c for c in self.clauses if not c.get("extra")]
        return sum(c["ok"] for c in real) / max(len(real), 1)

    @property
    def credit(self) -> float:
        """Mean per-clause credit (flow-GRPO's partial score)."""
        return sum(c["credit"] for c in self.clauses) / max(len(self.clauses), 1)


def relative_position(box_a, box_b, threshold: float = 0.1) -> set[str]:
    """Where box ``a`` sits relative to box ``b`` (GenEval's ``relative_position``): the
    centre offset, each axis shrunk by ``threshold`` times the two boxes' summed extent
    (so touching or overlapping objects relate weakly), divided by the offset's length; a
    component beyond 0.5 of it names the relation. Image y grows downward."""
    (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = box_a, box_b
    off_x, off_y = (ax0 + ax1 - bx0 - bx1) / 2, (ay0 + ay1 - by0 - by1) / 2
    shrunk = [
        max(abs(off) - threshold * (abs(a1 - a0) + abs(b1 - b0)), 0.0) * ((off > 0) - (off < 0))
        for off, a0, a1, b0, b1 in ((off_x, ax0, ax1, bx0, bx1), (off_y, ay0, ay1, by0, by1))
    ]
    if all(abs(s) < 1e-3 for s in shrunk):
        return set()
    norm = (off_x**2 + off_y**2) ** 0.5
    dx, dy = shrunk[0] / norm, shrunk[1] / norm
    return {
        name
        for name, holds in (
            ("left of", dx < -0.5),
            ("right of", dx > 0.5),
            ("above", dy < -0.5),
            ("below", dy > 0.5),
        )
        if holds
    }


def box_relation(threshold: float = 0.1) -> Callable[[Found, Found, str], bool]:
    return lambda a, b, relation: relation in relative_position(a.box, b.box, threshold)


ColourFn = Callable[[Sequence[Found], str], list[str]]


def judge(
    task: Task, detected: dict[str, list[Found]], colours: ColourFn, holds: Callable, rules: Rules
) -> Judgement:
    """Every clause of ``task`` over ``detected`` (per class, most confident first).

    ``colours(found, cls)`` names the colour of each found object (called only for groups
    whose count holds, as in GenEval); ``holds(a, b, relation)`` is the relation geometry.
    """
    out, groups = Judgement(), []
    for req in task.include:
        found = detected.get(req.cls, [])
        chosen = found if rules.exact_counts else found[: req.count]
        ok = len(found) == req.count if rules.exact_counts else len(chosen) >= req.count
        word = "exactly" if rules.exact_counts else "at least"
        out.clauses.append(
            {
                "clause": f"{word} {req.name()}",
                "ok": ok,
                "credit": _credit(req.count, len(found)),
                "found": len(found),
            }
        )
        if req.colour:
            named = colours(chosen, req.cls) if ok else []
            hits = named.count(req.colour)
            ok = ok and (hits == req.count if rules.exact_counts else hits >= req.count)
            credit = _credit(req.count, hits) if named else 0.0
            out.clauses.append({"clause": f"{req.colour} {req.cls}", "ok": ok, "credit": credit})
        groups.append((chosen, ok))
    for req, (chosen, ok) in zip(task.include, groups):
        if req.position:
            relation, target = req.position
            target_found, target_ok = groups[target]
            judged = not rules.relation_needs_groups or (ok and target_ok)
            pairs = [holds(a, b, relation) for a in chosen for b in target_found] if judged else []
            met = bool(pairs) and (all(pairs) if rules.every_pair else any(pairs))
            text = f"{req.name()} {relation} {task.include[target].name()}"
            out.clauses.append({"clause": text, "ok": met, "credit": float(met)})
            if judged and not met and rules.failed_relation_extra:
                extra = "flow-GRPO's extra credit after a failed relation"
                out.clauses.append({"clause": extra, "ok": True, "credit": 1.0, "extra": True})
    if rules.use_exclude:
        for req in task.exclude:
            n = len(detected.get(req.cls, []))
            out.clauses.append(
                {
                    "clause": f"fewer than {req.count} {req.cls}",
                    "ok": n < req.count,
                    "credit": float(n < req.count),
                }
            )
    return out


def _credit(count: int, found: int) -> float:
    return 1.0 - abs(count - found) / count


# ----------------------------------------------------------------------------- captions

# GenEval's classes (prompts/object_names.txt: COCO's 80, with mouse, remote and keyboard
# renamed so a caption is unambiguous) and its colour words
COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich",
    "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse",
    "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
GENEVAL_COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
NUMBER_WORDS = {
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
}
CAPTION_HELP = (
    "GenEval captions look like 'a photo of a dog', 'a photo of a cat and a dog', 'a photo of "
    "three dogs', 'a photo of a red dog', 'a photo of a cat left of a dog' or 'a photo of a red "
    "cat and a blue dog' (positions: left of, right of, above, below)"
)


class CaptionError(ValueError):
    """A prompt is not one of GenEval's caption templates (or names an unknown class)."""


def plural(name: str) -> str:
    """GenEval's plural (``make_plural``): ``es`` after an s, else ``s``."""
    return f"{name}es" if name.endswith("s") else f"{name}s"


# English plurals GenEval's rule misses ("knifes", "persons", "computer mouses") and words
# that are already plural ("skis", "scissors"); a caption may use either spelling
IRREGULAR_PLURALS = {
    "person": ("people", "persons"),
    "knife": ("knives",),
    "computer mouse": ("computer mice",),
    "sheep": ("sheep",),
    "skis": ("skis", "pairs of skis"),
    "scissors": ("scissors", "pairs of scissors"),
}


def plurals(name: str) -> set[str]:
    """Every accepted plural of a class: GenEval's, English's (``-es`` after s, x, z, ch,
    sh; consonant + y -> ies) and the irregular ones."""
    english = name + ("es" if name.endswith(("s", "x", "z", "ch", "sh")) else "s")
    if name.endswith("y") and name[-2:-1] not in "aeiou":
        english = name[:-1] + "ies"
    return {plural(name), english, *IRREGULAR_PLURALS.get(name, ())}


def article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def parse_caption(prompt: str, classes=COCO_CLASSES, colours=GENEVAL_COLOURS) -> Task:
    """The GenEval task a caption from GenEval's six templates asks for (``create_prompts.py``):
    single_object, two_object, counting (which also excludes ``n + 1``), colors, position
    (the second-named object is the target: "a photo of A left of B" puts A left of B) and
    color_attr. Case, spacing and a closing full stop do not matter; counts may be words
    (two to ten, as GenEval writes them) or digits, and plurals GenEval's or English's
    (:func:`plurals`). Raises :class:`CaptionError` otherwise."""
    text = " ".join(str(prompt).strip().split()).lower().rstrip(".").rstrip()
    if not text.startswith("a photo of "):
        raise CaptionError(f"{prompt!r} does not start with 'a photo of'. {CAPTION_HELP}")
    rest = text[len("a photo of ") :]
    objects, tinted, counted = _phrases(tuple(classes), tuple(colours))
    if rest in objects:
        return Task(prompt, "single_object", (Requirement(objects[rest], 1),))
    if rest in tinted:
        colour, cls = tinted[rest]
        return Task(prompt, "colors", (Requirement(cls, 1, colour),))
    if rest in counted:
        n, cls = counted[rest]
        return Task(prompt, "counting", (Requirement(cls, n),), (Requirement(cls, n + 1),))
    for first, second in _splits(rest, " and "):
        if first in objects and second in objects:
            return Task(
                prompt, "two_object", (Requirement(objects[first], 1), Requirement(objects[second], 1))
            )
        if first in tinted and second in tinted:
            (ka, ca), (kb, cb) = tinted[first], tinted[second]
            return Task(prompt, "color_attr", (Requirement(ca, 1, ka), Requirement(cb, 1, kb)))
    for relation in POSITIONS:
        for first, second in _splits(rest, f" {relation} "):
            if first in objects and second in objects:
                target, moved = (
                    Requirement(objects[second], 1),
                    Requirement(objects[first], 1, position=(relation, 0)),
                )
                return Task(prompt, "position", (target, moved))
    raise CaptionError(f"{prompt!r} is not a GenEval caption over the known classes. {CAPTION_HELP}")


@functools.lru_cache(maxsize=8)
def _phrases(classes: tuple[str, ...], colours: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """The object phrases a caption is built of ("a dog", "a red dog", "two dogs"), built
    once per vocabulary (a prompt file is checked caption by caption)."""
    objects = {article(c): c for c in classes}
    tinted = {f"{article(k)} {c}": (k, c) for k in colours for c in classes}
    numbers = {**NUMBER_WORDS, **{str(n): n for n in NUMBER_WORDS.values()}}
    counted = {f"{w} {p}": (n, c) for w, n in numbers.items() for c in classes for p in plurals(c)}
    return objects, tinted, counted


def _splits(text: str, sep: str):
    """Every way of cutting ``text`` at one occurrence of ``sep`` (class names may contain it)."""
    start = text.find(sep)
    while start != -1:
        yield text[:start], text[start + len(sep) :]
        start = text.find(sep, start + 1)


def task_from_metadata(meta: dict, prompt: str, classes=COCO_CLASSES, colours=GENEVAL_COLOURS) -> Task:
    """The task of a metadata line (GenEval's ``evaluation_metadata.jsonl``, flow_grpo's
    ``*_metadata.jsonl``: ``tag``, ``include``, optional ``exclude``), checked: every class
    known, counts positive, colours known, positions naming an earlier include. This is
    what flow_grpo's reward server scores from (``gen_eval.py: evaluate_reward`` reads
    ``metadata["include"]``); the caption text is not parsed. Raises :class:`CaptionError`
    naming the first problem."""

    def fail(what: str):
        raise CaptionError(f"{str(prompt)!r}: its metadata {what}")

    include, exclude = meta.get("include"), meta.get("exclude", [])
    if not isinstance(include, list) or not include:
        fail("has no 'include' list of {'class', 'count'} objects")
    if not isinstance(exclude, list):
        fail("'exclude' is not a list")
    for i, r in enumerate(include + exclude):
        if not isinstance(r, dict) or r.get("class") not in classes:
            got = r.get("class") if isinstance(r, dict) else r
            fail(f"names class {got!r}, not one of the detector's {len(classes)} classes")
        if not isinstance(r.get("count"), int) or r["count"] < 1:
            fail(f"gives {r['class']!r} the count {r.get('count')!r} (a positive integer is needed)")
        if r.get("color") is not None and r["color"] not in colours:
            fail(f"colours {r['class']!r} {r['color']!r}, not one of {', '.join(colours)}")
        position = r.get("position")
        if position is not None and not (
            i < len(include)
            and isinstance(position, (list, tuple))
            and len(position) == 2
            and position[0] in POSITIONS
            and isinstance(position[1], int)
            and 0 <= position[1] < i
        ):
            fail(f"places {r['class']!r} at {position!r}; a position is [relation, earlier include's index]")
    return Task.from_metadata({**meta, "prompt": prompt})


def prompt_task(prompt: str, classes=COCO_CLASSES, colours=GENEVAL_COLOURS) -> Task:
    """A prompt's task: from the metadata it carries when that has an ``include`` list
    (:class:`~rewards.prompts.AnnotatedPrompt`, a line of a GenEval metadata file), else
    from its caption (:func:`parse_caption`)."""
    meta = getattr(prompt, "metadata", None) or {}
    if "include" in meta:
        return task_from_metadata(meta, str(prompt), classes, colours)
    return parse_caption(prompt, classes, colours)


def check_captions(
    prompts, classes=COCO_CLASSES, colours=GENEVAL_COLOURS, who: str = "geneval reward"
) -> None:
    """One :class:`CaptionError` naming every prompt that has no task (see :func:`prompt_task`)."""
    bad = []
    for prompt in prompts:
        try:
            prompt_task(prompt, classes, colours)
        except CaptionError as err:  # a metadata error says what is wrong; a caption is shown
            bad.append(
                str(err) if "include" in (getattr(prompt, "metadata", None) or {}) else repr(str(prompt))
            )
    if bad:
        shown = "; ".join(bad[:3]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")
        raise CaptionError(
            f"{who}: {len(bad)} prompt(s) have no GenEval task: {shown}. {CAPTION_HELP}, or give each "
            "line GenEval's metadata (a .jsonl line with 'tag', 'include' and optionally 'exclude', "
            "as GenEval's and flow_grpo's metadata files have)"
        )
