"""ShapeWorld video: objects that move as the prompt says, and a verifier that checks the
motion from the frames.

Prompts are ``"a {colour} {shape} moving {left|right|up|down}"``. A rendered clip places
the object and moves it a constant number of pixels per frame in that direction. The
verifier detects objects in every frame with the image verifier's detector
(:func:`rewards.shapeworld.verifier.detect`) and checks two clauses (GenEval-style, as the
image task): **present**, exactly one object of the named colour and shape in at least
``min_present`` of the frames; **moves**, its centroid travels from the first to the last
frame where it is seen by at least ``min_shift`` of the side along the named direction, and
farther along it than across it. A third measure is logged but not scored:
**coherent**, the object's track is continuous: found in at least ``min_present`` of the
frames (as for present; ``min_present=1`` asks for every frame), and between consecutive
sightings its centroid moves at most ``max_jump`` of the side per frame elapsed (0.2 x 32 =
6.4 px, twice the shipped clips' 3 px per frame). A model whose objects jump between frames
fails it even when its first and last frames happen to line up. Video rewards that do
not move or that drift (DanceGRPO #34, #41, #95, #98) are what this task makes visible: a
clip that stands still, or moves the wrong way, fails ``moves`` whatever its frames look
like.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

import numpy as np
import torch

from rewards.images import RewardInputError
from rewards.shapeworld import grammar
from rewards.shapeworld.render import Placed, draw
from rewards.shapeworld.verifier import detect

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
_PROMPT = re.compile(
    rf"^a ({'|'.join(grammar.COLOURS)}) ({'|'.join(grammar.SHAPES)}) moving ({'|'.join(DIRECTIONS)})$"
)
VIDEO_HELP = (
    "ShapeWorld video prompts look like 'a red circle moving left' (colours "
    f"{'|'.join(grammar.COLOURS)}; shapes {'|'.join(grammar.SHAPES)}; directions {'|'.join(DIRECTIONS)})"
)


@dataclass(frozen=True)
class Motion:
    colour: str
    shape: str
    direction: str

    def caption(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.direction}"


def parse_motion(prompt: str) -> Motion:
    text = " ".join(str(prompt).lower().strip().rstrip(".").split())
    m = _PROMPT.match(text)
    if not m:
        raise grammar.PromptGrammarError(f"prompt '{prompt}' is outside the video grammar. {VIDEO_HELP}")
    return Motion(*m.groups())


def render_clip(motion: Motion, rnd: random.Random, frames: int = 8, resolution: int = 32, step: int = 2):
    """(frames, H, W, 3) uint8: the object starts where it can travel ``step`` pixels per
    frame in its direction and stay inside the canvas."""
    size = rnd.randint(resolution // 5, resolution // 3)
    travel = step * (frames - 1)
    dx, dy = DIRECTIONS[motion.direction]
    lo_x, hi_x = max(0, -dx * travel), resolution - size - max(0, dx * travel)
    lo_y, hi_y = max(0, -dy * travel), resolution - size - max(0, dy * travel)
    if hi_x < lo_x or hi_y < lo_y:
        raise ValueError(f"{frames} frames of {step} px do not fit a {size} px object in {resolution} px")
    x, y = rnd.randint(lo_x, hi_x), rnd.randint(lo_y, hi_y)
    clip = [
        draw([Placed(motion.colour, motion.shape, x + dx * step * f, y + dy * step * f, size)], resolution)
        for f in range(frames)
    ]
    return np.stack(clip)


@dataclass
class VideoVerdict:
    prompt: str
    strict: float
    partial: float
    clauses: list[dict]
    reason: str = ""
    coherent: bool = False  # logged, not scored: the track is continuous (see the module docstring)


class ShapeWorldVideoVerifier:
    """Registered as ``shapeworld_video``: scores (B, F, 3, H, W) clips in [0, 1] against
    their prompts. ``score``: ``partial`` (the default), ``strict`` or ``mean``."""

    name = "shapeworld_video"

    def __init__(
        self,
        score: str = "partial",
        min_present: float = 0.75,
        min_shift: float = 0.15,
        max_jump: float = 0.2,
    ):
        if score not in ("partial", "strict", "mean"):
            raise ValueError(f"shapeworld_video: score must be 'partial', 'strict' or 'mean', got '{score}'")
        if not (0 < min_present <= 1 and 0 < min_shift < 1 and 0 < max_jump <= 1):
            raise ValueError(
                "shapeworld_video: min_present must be in (0, 1], min_shift in (0, 1) and max_jump in (0, 1]"
            )
        self.score, self.min_present, self.min_shift = score, float(min_present), float(min_shift)
        self.max_jump = float(max_jump)

    @classmethod
    def prompt_checker(cls, **args):
        """The prompt check for ``--dry-run`` and ``--preflight``: this reward has no weights,
        so it is built and asked."""
        return cls(**args).check_prompts

    def check_prompts(self, prompts: list[str]) -> None:
        bad = []
        for p in prompts:
            try:
                parse_motion(p)
            except grammar.PromptGrammarError:
                bad.append(repr(str(p)))
        if bad:
            raise grammar.PromptGrammarError(
                f"shapeworld_video reward: {len(bad)} prompt(s) outside the grammar: {'; '.join(bad[:5])}. "
                f"{VIDEO_HELP}"
            )

    def verdict(self, prompt: str, frames: list[list], height: int, width: int) -> VideoVerdict:
        try:
            motion = parse_motion(prompt)
        except grammar.PromptGrammarError as err:
            return VideoVerdict(str(prompt), 0.0, 0.0, [], reason=str(err))
        track = []
        for dets in frames:
            named = [d for d in dets if (d.colour, d.shape) == (motion.colour, motion.shape)]
            track.append((named[0].cx / width, named[0].cy / height) if len(named) == 1 else None)
        seen = [p for p in track if p is not None]
        present = len(seen) >= self.min_present * len(track)
        moves = False
        if len(seen) >= 2:
            dx, dy = seen[-1][0] - seen[0][0], seen[-1][1] - seen[0][1]
            ux, uy = DIRECTIONS[motion.direction]
            along, across = dx * ux + dy * uy, abs(dx * uy - dy * ux)
            moves = along >= self.min_shift and along > across
        clauses = [
            {
                "clause": f"one {motion.colour} {motion.shape} in the frames",
                "ok": present,
                "found": len(seen),
            },
            {"clause": f"it moves {motion.direction}", "ok": moves},
        ]
        satisfied = sum(c["ok"] for c in clauses)
        verdict = VideoVerdict(str(prompt), float(satisfied == 2), satisfied / 2, clauses)
        verdict.coherent = present and self._continuous(track)
        return verdict

    def _continuous(self, track: list) -> bool:
        """Each step between consecutive sightings at most ``max_jump`` of the side per
        frame elapsed (positions are fractions of the side)."""
        seen = [(f, p) for f, p in enumerate(track) if p is not None]
        for (fa, a), (fb, b) in zip(seen, seen[1:]):
            if ((b[0] - a[0]) ** 2 + (b[1] - a[1]) ** 2) ** 0.5 > self.max_jump * (fb - fa):
                return False
        return True

    def __call__(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        if not isinstance(images, torch.Tensor) or images.ndim != 5 or images.shape[2] != 3:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise RewardInputError(f"shapeworld_video scores clips (B, F, 3, H, W) in [0, 1]; got {shape}")
        b, f, _, h, w = images.shape
        if len(prompts) != b:
            raise ValueError(f"shapeworld_video: {b} clips but {len(prompts)} prompts")
        dets = detect(images.float().flatten(0, 1))
        verdicts = [self.verdict(p, dets[i * f : (i + 1) * f], h, w) for i, p in enumerate(prompts)]
        if isinstance(metadata, dict):
            metadata[self.name] = verdicts
        strict = torch.tensor([v.strict for v in verdicts])
        partial = torch.tensor([v.partial for v in verdicts])
        present, moves = (
            torch.tensor([float(v.clauses[i]["ok"]) if v.clauses else 0.0 for v in verdicts]) for i in (0, 1)
        )
        score = {"partial": partial, "strict": strict, "mean": (strict + partial) / 2}[self.score]
        return {
            self.name: score,
            "shapeworld_video_strict": strict,
            "shapeworld_video_present": present,
            "shapeworld_video_moves": moves,
            "shapeworld_video_coherent": torch.tensor([float(v.coherent) for v in verdicts]),
        }


def video_split(seed: int = 0, heldout_fraction: float = 0.25) -> tuple[list[str], list[str]]:
    """(train, held-out) captions: a ``heldout_fraction`` of (colour, shape, direction)
    combinations never appear in training."""
    captions = [
        Motion(c, s, d).caption()
        for c, s, d in itertools.product(grammar.COLOURS, grammar.SHAPES, DIRECTIONS)
    ]
    rnd = random.Random(seed)
    rnd.shuffle(captions)
    cut = round(heldout_fraction * len(captions))
    return captions[cut:], captions[:cut]


def write_video_prompt_files(directory, seed: int = 0) -> None:
    """``train.txt`` and ``heldout.txt`` (shipped in assets/shapeworld/video)."""
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, captions in zip(("train", "heldout"), video_split(seed)):
        header = (
            f"# ShapeWorld video {name} prompts: rewards.shapeworld.video.video_split(seed={seed});\n"
            "# regenerate\n"
            '# with python -c "from rewards.shapeworld.video import write_video_prompt_files; '
            "write_video_prompt_files('assets/shapeworld/video')\"\n"
        )
        (directory / f"{name}.txt").write_text(header + "".join(c + "\n" for c in captions))
