"""ShapeWorld video: clips rendered as the prompt says pass, and the verifier names what a
clip that stands still, moves the wrong way or shows the wrong object gets wrong (the
renderer is an independent code path: the verifier only sees pixels)."""

from __future__ import annotations

import random

import pytest
import torch

from rewards import build
from rewards.images import RewardInputError
from rewards.shapeworld import grammar
from rewards.shapeworld.video import DIRECTIONS, Motion, parse_motion, render_clip, video_split


def _clips(motions, seed=0, frames=8):
    rnd = random.Random(seed)
    clips = [torch.from_numpy(render_clip(m, rnd, frames)).permute(0, 3, 1, 2) for m in motions]
    return torch.stack(clips).float() / 255


def test_rendered_clips_pass_in_every_direction():
    motions = [Motion(c, s, d) for (c, s), d in zip([("red", "circle"), ("blue", "square")] * 2, DIRECTIONS)]
    out = build("shapeworld_video")(_clips(motions), [m.caption() for m in motions])
    assert (
        out["shapeworld_video"].tolist() == [1.0] * 4 and out["shapeworld_video_strict"].tolist() == [1.0] * 4
    )


def test_still_reversed_and_wrong_clips_fail_the_clause_they_break():
    verifier = build("shapeworld_video")
    motion = Motion("green", "triangle", "right")
    clip = _clips([motion])
    still = clip[:, :1].expand_as(clip).clone()
    reversed_ = clip.flip(1)
    cases = {
        "moves": (clip, (True, True)),
        "still": (still, (True, False)),
        "reversed": (reversed_, (True, False)),
        "wrong colour": (_clips([Motion("red", "triangle", "right")]), (False, False)),
    }
    for name, (video, expected) in cases.items():
        meta = {}
        out = verifier(video, [motion.caption()], meta)
        assert tuple(c["ok"] for c in meta["shapeworld_video"][0].clauses) == expected, name
        assert out["shapeworld_video"].item() == pytest.approx(sum(expected) / 2), name
        assert out["shapeworld_video_present"].item() == float(expected[0]), name
        assert out["shapeworld_video_moves"].item() == float(expected[1]), name


def test_grammar_split_and_errors():
    assert parse_motion("A red circle moving left.") == Motion("red", "circle", "left")
    train, held = video_split()
    assert len(train) + len(held) == len(grammar.COLOURS) * len(grammar.SHAPES) * 4 and not set(train) & set(
        held
    )
    verifier = build("shapeworld_video")
    with pytest.raises(grammar.PromptGrammarError, match="outside the grammar"):
        verifier.check_prompts(["a red circle moving left", "a cat"])
    with pytest.raises(RewardInputError, match=r"clips \(B, F, 3, H, W\)"):
        verifier(torch.rand(2, 3, 32, 32), ["a red circle moving left"] * 2)
    meta = {}
    assert verifier(torch.ones(1, 4, 3, 32, 32), ["a dog"], meta)["shapeworld_video"].item() == 0
    assert "outside the video grammar" in meta["shapeworld_video"][0].reason


def test_shipped_prompt_files_are_the_split():
    from diffrl.training.data import PROJECT_ROOT, load_prompts

    train, held = video_split()
    assert load_prompts(PROJECT_ROOT / "assets/shapeworld/video/train.txt") == train
    assert load_prompts(PROJECT_ROOT / "assets/shapeworld/video/heldout.txt") == held
