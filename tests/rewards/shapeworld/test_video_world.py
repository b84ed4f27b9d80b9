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
    from diffrl.data.prompts import PROJECT_ROOT, load_prompts

    train, held = video_split()
    assert load_prompts(PROJECT_ROOT / "assets/shapeworld/video/train.txt") == train
    assert load_prompts(PROJECT_ROOT / "assets/shapeworld/video/heldout.txt") == held


def test_coherence_is_a_continuous_track_not_the_end_points():
    """A clip whose middle frames are shuffled starts and ends right (moves passes) but its
    object jumps 10 px and more between frames (> 0.2 x 32 = 6.4 px): not coherent. A still
    clip is coherent though it fails moves; a track with one frame missed is continuous, one
    seen in fewer than min_present of the frames is not."""
    verifier = build("shapeworld_video")
    motion = Motion("blue", "circle", "left")
    clip = _clips([motion])  # 8 frames, 2 px per frame
    shuffled = clip[:, [0, 6, 1, 5, 2, 4, 3, 7]]
    still = clip[:, :1].expand_as(clip).clone()
    gap, gaps = clip.clone(), clip.clone()
    gap[:, 3] = 1.0  # one blank white frame: 7 of 8 sightings, their steps 2 px per frame
    gaps[:, 2:5] = 1.0  # three: 5 of 8, below min_present
    cases = {"moves": (clip, 1.0, 1.0), "shuffled": (shuffled, 1.0, 0.0), "still": (still, 0.0, 1.0)}
    cases.update(gap=(gap, 1.0, 1.0), gaps=(gaps, 1.0, 0.0))
    for name, (video, moves, coherent) in cases.items():
        out = verifier(video, [motion.caption()])
        assert out["shapeworld_video_moves"].item() == moves, name
        assert out["shapeworld_video_coherent"].item() == coherent, name
    strict = build("shapeworld_video", max_jump=0.05)  # 1.6 px: the 2 px steps are jumps now
    assert strict(clip, [motion.caption()])["shapeworld_video_coherent"].item() == 0.0
    every = build("shapeworld_video", min_present=1.0)  # every frame: the gap breaks the track
    assert every(gap, [motion.caption()])["shapeworld_video_coherent"].item() == 0.0
    with pytest.raises(ValueError, match="max_jump"):
        build("shapeworld_video", max_jump=0)
