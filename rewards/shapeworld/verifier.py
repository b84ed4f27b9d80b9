"""ShapeWorld verifier: a GenEval-style reward computed from pixels, with no model.

The prompt is parsed into clauses (:mod:`rewards.shapeworld.grammar`); objects are detected by
colour segmentation (nearest palette colour on non-background pixels), connected
components (4-connected, same colour) and shape classification by how much of its
bounding box a component fills (square ~1, circle ~pi/4, triangle ~1/2). Centroids
decide relations. In the late-step world a component is striped when its vertically
adjacent pixels differ more than its horizontally adjacent ones by over
:data:`STRIPED_ABOVE`, solid below :data:`SOLID_BELOW` and unclear between, and a
textured prompt's classes include the texture. Scores follow GenEval (Ghosh et
al. 2023): ``strict`` is 1 when every clause holds, ``partial`` is the fraction of
clauses that hold.

Prompts outside the grammar score 0 with the reason recorded; they never raise inside
a run. ``check_prompts`` raises one clear error for a whole prompt list up front.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rewards import geneval_rules as rules
from rewards.errors import some_of
from rewards.geneval_rules import Found, Requirement, Task
from rewards.images import RewardInputError, to_tensor_batch
from rewards.shapeworld import grammar
from rewards.shapeworld.fidelity import fidelity
from rewards.shapeworld.render import BACKGROUND, PALETTE, Placed, relation_holds

_PALETTE = torch.tensor(list(PALETTE.values()), dtype=torch.float32) / 255
_NAMES = list(PALETTE)
# rendered stripes differ by 0.21-0.23 (max over channels, in [0, 1]) between rows and by
# 0 within a row (render.STRIPE_TINT); a solid object differs by 0 both ways. Between the
# two bounds a texture is "unclear" and satisfies neither word: a model that hedges with
# half-contrast stripes (seen early in the late base's pretraining) must not pass as both
STRIPED_ABOVE = 0.14
SOLID_BELOW = 0.07


@dataclass(frozen=True)
class Detection:
    colour: str
    shape: str
    cx: float
    cy: float
    area: int
    fill: float
    box: tuple[int, int, int, int] = (0, 0, 0, 0)  # pixel extent (x0, y0, x1, y1), inclusive
    stripes: float = 0.0  # mean |row-to-row| minus mean |column-to-column| change inside it

    @property
    def texture(self) -> str:
        if self.stripes > STRIPED_ABOVE:
            return "striped"
        return "solid" if self.stripes < SOLID_BELOW else "unclear"


@dataclass
class Verdict:
    """Scores of one image against one prompt, with each clause and what was found."""

    prompt: str
    strict: float
    partial: float
    clauses: list[dict] = field(default_factory=list)
    detections: list[Detection] = field(default_factory=list)
    reason: str = ""
    kind: str = ""  # the prompt's kind (count / pair / relation); "" when unparseable
    shapes_ok: bool | None = None  # textured prompts: every group right, textures aside

    def objects_ok(self) -> bool:
        """Every object-group clause holds (the relation clause, if any, aside)."""
        return all(c["ok"] for c in self.clauses if "found" in c)

    def relation_ok(self) -> bool:
        return any(c["ok"] for c in self.clauses if "found" not in c)


def connected_components(labels: torch.Tensor) -> torch.Tensor:
    """4-connected components of equal non-negative labels, batched over (B, H, W).

    Returns a component id per pixel (-1 for background, label < 0): each pixel takes
    the smallest linear index in its component, found by repeated min-propagation
    between equal-labelled neighbours (converges in at most H*W sweeps; shapes here
    need about their diameter).
    """
    b, h, w = labels.shape
    big = b * h * w
    ids = torch.arange(big, dtype=torch.long).view(b, h, w)
    ids = torch.where(labels >= 0, ids, torch.full_like(ids, big))
    pad_lab = torch.nn.functional.pad(labels, (1, 1, 1, 1), value=-1)
    neighbours = [(0, 1), (2, 1), (1, 0), (1, 2)]  # up, down, left, right in padded coords
    same = [pad_lab[:, dy : dy + h, dx : dx + w] == labels for dy, dx in neighbours]
    for _ in range(h * w):
        pad_ids = torch.nn.functional.pad(ids, (1, 1, 1, 1), value=big)
        new = ids
        for (dy, dx), ok in zip(neighbours, same):
            new = torch.minimum(new, torch.where(ok, pad_ids[:, dy : dy + h, dx : dx + w], big))
        new = torch.where(labels >= 0, new, big)
        if torch.equal(new, ids):
            break
        ids = new
    return torch.where(labels >= 0, ids, -1)


def classify_shape(fill: float) -> str:
    """Square fills its box, a circle pi/4 of it, an upright triangle half of it."""
    if fill >= 0.9:
        return "square"
    return "circle" if fill >= 0.66 else "triangle"


def detect(images, fg_threshold: float = 0.3, min_area: int = 10) -> list[list[Detection]]:
    """Objects in each image of a (B, 3, H, W) batch in [0, 1] (or PIL list).

    A pixel is foreground when some channel is more than ``fg_threshold`` from the white
    background; components smaller than ``min_area`` pixels (at 32 px; scaled with the
    image area) are noise and ignored.
    """
    batch = to_tensor_batch(images).float()
    if batch.ndim != 4:
        raise RewardInputError(f"shapeworld scores images (B, 3, H, W); got shape {tuple(batch.shape)}")
    b, _, h, w = batch.shape
    background = torch.tensor(BACKGROUND, dtype=torch.float32).view(1, 3, 1, 1) / 255
    foreground = (batch - background).abs().amax(1) > fg_threshold
    dist = ((batch.permute(0, 2, 3, 1).unsqueeze(-2) - _PALETTE) ** 2).sum(-1)  # (B, H, W, K)
    labels = torch.where(foreground, dist.argmin(-1), -1)
    comp = connected_components(labels)
    min_pixels = max(1, round(min_area * h * w / 1024))
    return [_components(comp[i], labels[i], min_pixels, batch[i]) for i in range(b)]


def _neighbour_change(comp: torch.Tensor, image: torch.Tensor, dy: int, dx: int) -> tuple:
    """(component id, max-channel |change|) for every pixel whose neighbour at (+dy, +dx)
    lies in the same component."""
    h, w = comp.shape
    here, there = comp[: h - dy, : w - dx], comp[dy:, dx:]
    same = (here >= 0) & (here == there)
    change = (image[:, : h - dy, : w - dx] - image[:, dy:, dx:]).abs().amax(0)
    return here[same], change[same]


def _stripe_scores(comp: torch.Tensor, image: torch.Tensor, uniq: torch.Tensor) -> torch.Tensor:
    """Per component of ``uniq``: mean vertical minus mean horizontal neighbour change."""
    scores = []
    for dy, dx in ((1, 0), (0, 1)):
        ids, change = _neighbour_change(comp, image, dy, dx)
        index = torch.searchsorted(uniq, ids)
        total = torch.zeros(len(uniq)).scatter_add_(0, index, change)
        count = torch.zeros(len(uniq)).scatter_add_(0, index, torch.ones_like(change))
        scores.append(total / count.clamp(min=1))
    return scores[0] - scores[1]


def _components(
    comp: torch.Tensor, labels: torch.Tensor, min_pixels: int, image: torch.Tensor
) -> list[Detection]:
    h, w = comp.shape
    mask = comp >= 0
    if not mask.any():
        return []
    ys, xs = torch.nonzero(mask, as_tuple=True)
    uniq, inverse = torch.unique(comp[mask], return_inverse=True)
    n = len(uniq)
    area = torch.zeros(n).scatter_add_(0, inverse, torch.ones(len(xs)))
    sum_x = torch.zeros(n).scatter_add_(0, inverse, xs.float() + 0.5)
    sum_y = torch.zeros(n).scatter_add_(0, inverse, ys.float() + 0.5)

    def extent(v, reduce, init):
        return torch.full((n,), init, dtype=torch.long).scatter_reduce(0, inverse, v, reduce)

    x0, x1 = extent(xs, "amin", w), extent(xs, "amax", -1)
    y0, y1 = extent(ys, "amin", h), extent(ys, "amax", -1)
    bw, bh = x1 - x0 + 1, y1 - y0 + 1
    colour = labels.flatten()[uniq % (h * w)]  # ids are linear indices over the batch
    stripes = _stripe_scores(comp, image, uniq)
    out = []
    for k in range(n):
        if area[k] < min_pixels:
            continue
        fill = float(area[k] / (bw[k] * bh[k]))
        out.append(
            Detection(
                _NAMES[int(colour[k])],
                classify_shape(fill),
                float(sum_x[k] / area[k]),
                float(sum_y[k] / area[k]),
                int(area[k]),
                round(fill, 3),
                (int(x0[k]), int(y0[k]), int(x1[k]), int(y1[k])),
                round(float(stripes[k]), 4),
            )
        )
    return out


def as_found(d: Detection) -> Found:
    """A zero-size box at the centroid: ShapeWorld relations compare centroids."""
    return Found((d.cx, d.cy, d.cx, d.cy), colour=d.colour)


def _centroids_relate(margin: float):
    def holds(a: Found, b: Found, relation: str) -> bool:
        (ax, ay, _, _), (bx, by, _, _) = a.box, b.box
        return relation_holds(Placed("", "", ax, ay, 0), Placed("", "", bx, by, 0), relation, margin)

    return holds


def _class(colour: str, shape: str, texture: str | None) -> str:
    return f"{texture} {colour} {shape}" if texture else f"{colour} {shape}"


def as_task(spec: grammar.Spec, prompt: str, textures: bool = True) -> Task:
    """The ShapeWorld spec as GenEval requirements: each (colour, shape) is a class (with
    its texture, for a textured prompt unless ``textures`` is off), and a relation puts
    group 0 relative to group 1."""
    include = tuple(
        Requirement(
            _class(g.colour, g.shape, g.texture if textures else None),
            g.count,
            position=(spec.relation, 1) if spec.relation and i == 0 else None,
            label=g.text(),
        )
        for i, g in enumerate(spec.groups)
    )
    return Task(prompt, spec.kind, include)


def verify(prompt: str, detections: list[Detection], margin: float = 2.0) -> Verdict:
    """Score one image's detections against ``prompt`` (0 with a reason if unparseable),
    by the shared GenEval rules with ShapeWorld's settings (:data:`rules.SHAPEWORLD`)."""
    try:
        spec = grammar.parse(prompt)
    except grammar.PromptGrammarError as err:
        return Verdict(prompt, 0.0, 0.0, detections=detections, reason=str(err))
    textured = spec.groups[0].texture is not None
    judged = _judge(spec, prompt, detections, margin, textured)
    clauses = [{k: v for k, v in c.items() if k != "credit"} for c in judged.clauses]
    shapes_ok = None
    if textured:  # the same groups with textures left out: were the shapes right?
        shapes_ok = all(
            c["ok"] for c in _judge(spec, prompt, detections, margin, False).clauses if "found" in c
        )
    return Verdict(
        prompt,
        float(judged.correct),
        judged.fraction,
        clauses,
        detections,
        kind=spec.kind,
        shapes_ok=shapes_ok,
    )


def _judge(spec, prompt: str, detections: list[Detection], margin: float, textures: bool):
    by_class: dict[str, list[Found]] = {}
    for d in detections:
        by_class.setdefault(_class(d.colour, d.shape, d.texture if textures else None), []).append(
            as_found(d)
        )
    return rules.judge(
        as_task(spec, prompt, textures),
        by_class,
        _no_colour_clauses,
        _centroids_relate(margin),
        rules.SHAPEWORLD,
    )


def _no_colour_clauses(found, cls):  # colour is part of a ShapeWorld class, never asked apart
    raise AssertionError("ShapeWorld tasks have no colour clauses")


NAN = float("nan")


def breakdown(verdicts: list[Verdict]) -> dict[str, torch.Tensor]:
    """Per-sample diagnostics of where strict accuracy is lost, NaN where one does not apply
    (averages leave NaN out): strict accuracy per prompt kind (``shapeworld_kind/<kind>``),
    whether every object group is right (``shapeworld_clause/objects``), and for relation
    prompts whose objects are right, whether the relation holds
    (``shapeworld_clause/relation_given_objects``; about 0.43 when placement ignores the
    relation word)."""
    out = {
        f"shapeworld_kind/{k}": torch.tensor([v.strict if v.kind == k else NAN for v in verdicts])
        for k in grammar.KINDS
    }
    out["shapeworld_clause/objects"] = torch.tensor(
        [float(v.objects_ok()) if v.kind else NAN for v in verdicts]
    )
    out["shapeworld_clause/relation_given_objects"] = torch.tensor(
        [float(v.relation_ok()) if v.kind == "relation" and v.objects_ok() else NAN for v in verdicts]
    )
    if any(v.shapes_ok is not None for v in verdicts):  # the late-step world
        out["shapeworld_clause/shapes"] = torch.tensor(
            [NAN if v.shapes_ok is None else float(v.shapes_ok) for v in verdicts]
        )
        out["shapeworld_clause/texture_given_shapes"] = torch.tensor(
            [float(v.objects_ok()) if v.shapes_ok else NAN for v in verdicts]
        )
    return out


class ShapeWorldVerifier:
    """Registered as ``shapeworld``. ``score`` picks what is optimised: ``partial``
    (dense, the default), ``strict``, or ``mean`` of the two. Both are always logged
    (``shapeworld_strict``, ``shapeworld_partial``), and so are the fidelity measures of
    :mod:`rewards.shapeworld.fidelity` (``fidelity/background_darkness``, ``fidelity/stray_pixels``,
    ``fidelity/off_palette``), which evaluation reports as ``eval/fidelity/...``.

    ``background_penalty`` (lambda, default 0) turns the verifier into a damage-aware
    reward: score - lambda * stray_pixels, so that of two images satisfying the same
    clauses the one with the cleaner canvas ranks higher in its group. Each image's
    :class:`Verdict` is put in ``metadata["shapeworld"]`` when a metadata dict is passed."""

    name = "shapeworld"

    def __init__(
        self,
        score: str = "partial",
        fg_threshold: float = 0.3,
        min_area: int = 10,
        relation_margin: float = 2.0,
        background_penalty: float = 0.0,
    ):
        if score not in ("partial", "strict", "mean"):
            raise ValueError(f"shapeworld: score must be 'partial', 'strict' or 'mean', got '{score}'")
        if not background_penalty >= 0:
            raise ValueError(f"shapeworld: background_penalty must be >= 0, got {background_penalty}")
        self.score, self.fg_threshold, self.min_area = score, fg_threshold, min_area
        self.relation_margin, self.background_penalty = relation_margin, float(background_penalty)

    @classmethod
    def prompt_checker(cls, **args):
        """The prompt check for ``--dry-run`` and ``--preflight``: this reward has no weights,
        so it is built and asked."""
        return cls(**args).check_prompts

    def check_prompts(self, prompts: list[str]) -> None:
        """Raise one :class:`~rewards.shapeworld.grammar.PromptGrammarError` naming every bad prompt."""
        bad = []
        for p in prompts:
            try:
                grammar.parse(p)
            except grammar.PromptGrammarError:
                bad.append(p)
        if bad:
            shown = some_of(bad)
            raise grammar.PromptGrammarError(
                f"shapeworld reward: {len(bad)} prompt(s) outside the grammar: {shown}. "
                f"{grammar.GRAMMAR_HELP}"
            )

    def __call__(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        images = to_tensor_batch(images).float()
        dets = detect(images, self.fg_threshold, self.min_area)
        if len(prompts) != len(dets):
            raise ValueError(f"shapeworld: {len(dets)} images but {len(prompts)} prompts")
        verdicts = [verify(p, d, self.relation_margin) for p, d in zip(prompts, dets)]
        strict = torch.tensor([v.strict for v in verdicts])
        partial = torch.tensor([v.partial for v in verdicts])
        if isinstance(metadata, dict):
            metadata[self.name] = verdicts
        damage = {k: v.cpu() for k, v in fidelity(images, self.fg_threshold).items()}
        score = {"partial": partial, "strict": strict, "mean": (strict + partial) / 2}[self.score]
        if self.background_penalty:
            score = score - self.background_penalty * damage["fidelity/stray_pixels"]
        return {
            self.name: score,
            "shapeworld_strict": strict,
            "shapeworld_partial": partial,
            **damage,
            **breakdown(verdicts),
        }
