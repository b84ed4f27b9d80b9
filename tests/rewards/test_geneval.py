"""The GenEval rules shared with the ShapeWorld verifier, and the ``geneval`` reward on its
ShapeWorld twin (its models are tested in ``test_geneval_models.py``).

References: GenEval's published formulas transcribed here independently (the position
rule in numpy, the caption templates of its ``create_prompts.py``), hand-made detections
with known verdicts, and drawn ShapeWorld scenes.
"""

import json
import pickle
import random

import numpy as np
import pytest
import torch

import rewards
from rewards import geneval_rules as rules
from rewards.geneval import GenEval
from rewards.geneval_models import box_iou, keep
from rewards.geneval_rules import Found, Requirement
from rewards.prompts import AnnotatedPrompt
from rewards.shapeworld.render import Placed, draw

# ----------------------------------------------------------------------------- position rule


def geneval_position_numpy(box_a, box_b, threshold=0.1):
    """GenEval's relative_position, from its published description, in numpy."""
    boxes = np.array([box_a, box_b], dtype=np.float64).reshape(2, 2, 2)
    centre_a, centre_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = centre_a - centre_b
    revised = np.maximum(np.abs(offset) - threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    return {
        n
        for n, ok in (
            ("left of", dx < -0.5),
            ("right of", dx > 0.5),
            ("above", dy < -0.5),
            ("below", dy > 0.5),
        )
        if ok
    }


def test_relative_position_matches_the_numpy_transcription():
    rng = random.Random(0)
    seen = set()
    for _ in range(2000):
        a = sorted(rng.uniform(0, 100) for _ in range(2)), sorted(rng.uniform(0, 100) for _ in range(2))
        b = sorted(rng.uniform(0, 100) for _ in range(2)), sorted(rng.uniform(0, 100) for _ in range(2))
        box_a, box_b = (a[0][0], a[1][0], a[0][1], a[1][1]), (b[0][0], b[1][0], b[0][1], b[1][1])
        got = rules.relative_position(box_a, box_b)
        assert got == geneval_position_numpy(box_a, box_b), (box_a, box_b)
        seen |= got
    assert seen == set(rules.POSITIONS)
    assert rules.relative_position((0, 0, 10, 10), (20, 0, 30, 10)) == {"left of"}
    assert rules.relative_position((0, 0, 10, 10), (1, 0, 11, 10)) == set()  # within 10 % of the sizes: none


# ----------------------------------------------------------------------------- captions


def generated_caption(rng):
    """A caption and its metadata, by the six templates of GenEval's create_prompts.py."""
    classes, colours = rules.COCO_CLASSES, rules.GENEVAL_COLOURS
    a, b = rng.sample(classes, 2)
    ca, cb = rng.sample(colours, 2)
    kind = rng.randrange(6)
    if kind == 0:
        return f"a photo of {rules.article(a)}", [Requirement(a, 1)], []
    if kind == 1:
        return (
            f"a photo of {rules.article(a)} and {rules.article(b)}",
            [Requirement(a, 1), Requirement(b, 1)],
            [],
        )
    if kind == 2:
        n = rng.randint(2, 4)
        word = ["two", "three", "four"][n - 2]
        return f"a photo of {word} {rules.plural(a)}", [Requirement(a, n)], [Requirement(a, n + 1)]
    if kind == 3:
        return f"a photo of {rules.article(ca)} {a}", [Requirement(a, 1, ca)], []
    if kind == 4:
        rel = rng.choice(rules.POSITIONS)
        caption = f"a photo of {rules.article(a)} {rel} {rules.article(b)}"
        return caption, [Requirement(b, 1), Requirement(a, 1, position=(rel, 0))], []
    caption = f"a photo of {rules.article(ca)} {a} and {rules.article(cb)} {b}"
    return caption, [Requirement(a, 1, ca), Requirement(b, 1, cb)], []


def test_every_geneval_template_parses_back_to_its_metadata():
    rng = random.Random(1)
    tags = set()
    for _ in range(600):
        caption, include, exclude = generated_caption(rng)
        task = rules.parse_caption(caption)
        assert (list(task.include), list(task.exclude)) == (include, exclude), caption
        tags.add(task.tag)
    assert tags == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    # GenEval's own metadata lines load to the same task
    meta = {
        "tag": "position",
        "prompt": "p",
        "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
    }
    assert (
        rules.Task.from_metadata(meta).include
        == rules.parse_caption("a photo of a cat left of a dog").include
    )


@pytest.mark.parametrize(
    "caption", ["a dog", "a photo of a dragon", "a photo of five", "a photo of a red person left of a dog"]
)
def test_other_prompts_are_not_captions(caption):
    with pytest.raises(rules.CaptionError, match="GenEval captions look like"):
        rules.parse_caption(caption)


@pytest.mark.parametrize(
    "caption, spelled_as_geneval",
    [
        ("A photo of four knives.", "a photo of four knifes"),
        ("a photo of two people", "a photo of two persons"),
        ("a photo of 3 computer mice", "a photo of three computer mouses"),
        ("a photo of two couches", "a photo of two couchs"),
        ("A photo of a red  dog.", "a photo of a red dog"),
        ("a photo of two skis", "a photo of two skises"),
    ],
)
def test_a_users_spelling_reads_as_genevals(caption, spelled_as_geneval):
    assert rules.parse_caption(caption).include == rules.parse_caption(spelled_as_geneval).include


def test_metadata_is_checked_naming_what_is_wrong():
    ok = {"tag": "position", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1,
          "position": ["left of", 0]}]}  # fmt: skip
    assert rules.task_from_metadata(ok, "x").include[1].position == ("left of", 0)
    for broken, words in (
        ({}, "no 'include' list"),
        ({"include": [{"class": "dragon", "count": 1}]}, "class 'dragon'"),
        ({"include": [{"class": "dog", "count": 0}]}, "count 0"),
        ({"include": [{"class": "dog", "count": 1, "color": "teal"}]}, "'teal'"),
        ({"include": [{"class": "dog", "count": 1, "position": ["left of", 0]}]}, "earlier include's index"),
        ({"include": [{"class": "dog", "count": 1}], "exclude": {"class": "dog"}}, "'exclude' is not a list"),
    ):
        with pytest.raises(rules.CaptionError, match=words):
            rules.task_from_metadata(broken, "p")


# ----------------------------------------------------------------------------- the rules


def box(x, y, side=10):
    return (x, y, x + side, y + side)


def judge(task, detected, colours=None, rule=rules.GENEVAL):
    named = colours or {}
    return rules.judge(
        task, detected, lambda found, cls: [named[f.box] for f in found], rules.box_relation(), rule
    )


def test_counting_is_at_least_for_geneval_exact_for_flow_grpo_and_excludes_one_more():
    task = rules.parse_caption("a photo of two dogs")
    two = {"dog": [Found(box(0, 0), 0.99), Found(box(50, 0), 0.95)]}
    three = {"dog": two["dog"] + [Found(box(80, 0), 0.92)]}
    assert judge(task, two).correct and judge(task, two, rule=rules.FLOW_GRPO).correct
    assert not judge(task, three).correct  # the exclude clause: fewer than 3 dogs
    flow = judge(task, three, rule=rules.FLOW_GRPO)
    assert not flow.correct and flow.credit == pytest.approx(1 - 1 / 2)
    one = judge(rules.parse_caption("a photo of three dogs"), {"dog": two["dog"][:1]}, rule=rules.FLOW_GRPO)
    assert one.credit == pytest.approx(1 - 2 / 3)


def test_colour_is_judged_on_the_most_confident_objects_only_by_geneval():
    task = rules.parse_caption("a photo of a red car")
    cars = {"car": [Found(box(0, 0), 0.9), Found(box(50, 0), 0.5)]}
    colours = {box(0, 0): "red", box(50, 0): "blue"}
    assert judge(task, cars, colours).correct  # GenEval looks at the top car only
    flow = judge(task, cars, colours, rule=rules.FLOW_GRPO)  # two cars where one was asked
    assert not flow.correct and [c["credit"] for c in flow.clauses] == [0.0, 0.0]
    wrong = judge(task, {"car": cars["car"][:1]}, {box(0, 0): "blue"})
    assert not wrong.correct and [c["ok"] for c in wrong.clauses] == [True, False]


def test_position_needs_every_pair_and_both_groups():
    task = rules.parse_caption("a photo of a cat left of a dog")
    left = {"cat": [Found(box(0, 0))], "dog": [Found(box(50, 0))]}
    assert judge(task, left).correct
    right = {"cat": [Found(box(80, 0))], "dog": [Found(box(50, 0))]}
    assert not judge(task, right).correct
    # reward-server's evaluate_reward appends [dog 1, cat 1, relation 0.0, then 1.0]: 3/4
    assert judge(task, right, rule=rules.FLOW_GRPO).credit == pytest.approx((1 + 1 + 0 + 1) / 4)
    assert judge(task, right, rule=rules.FLOW_GRPO_PER_CLAUSE).credit == pytest.approx(2 / 3)
    assert not judge(task, right, rule=rules.FLOW_GRPO).correct  # the extra credit is no verdict
    no_dog = judge(task, {"cat": [Found(box(0, 0))]})
    assert [c["ok"] for c in no_dog.clauses] == [False, True, False]


def test_keep_is_genevals_filter():
    found = [Found(box(0, 0), s) for s in (0.2, 0.95, 0.5, 0.31)] + [Found(box(1, 0), 0.9)]
    assert [f.score for f in keep(found, 0.3, 16, 1.0)] == [0.95, 0.9, 0.5, 0.31]
    assert [f.score for f in keep(found, 0.3, 2, 1.0)] == [0.95, 0.9]
    assert [f.score for f in keep(found, 0.3, 16, 0.5)] == [0.95]  # the rest overlap the best box
    assert box_iou((0, 0, 9, 9), (0, 0, 9, 9)) == 1.0 and box_iou(
        (0, 0, 9, 9), (5, 0, 14, 9)
    ) == pytest.approx(50 / 150)


# ----------------------------------------------------------------------------- ShapeWorld twin


def scene(*objects, resolution=64):
    return torch.from_numpy(draw(list(objects), resolution)).permute(2, 0, 1).float()[None] / 255


@pytest.mark.parametrize(
    "caption, objects, partial, strict, correct",
    [
        (
            "a photo of two circles",
            [Placed("red", "circle", 5, 5, 12), Placed("blue", "circle", 40, 40, 12)],
            1,
            1,
            1,
        ),
        (
            "a photo of two circles",
            [
                Placed("red", "circle", 5, 5, 12),
                Placed("blue", "circle", 40, 40, 12),
                Placed("green", "circle", 5, 40, 12),
            ],
            0.5,
            0,
            0,
        ),
        (
            "a photo of a circle left of a square",
            [Placed("red", "circle", 5, 20, 12), Placed("blue", "square", 40, 20, 12)],
            1,
            1,
            1,
        ),
        (
            "a photo of a circle left of a square",
            [Placed("red", "circle", 40, 20, 12), Placed("blue", "square", 5, 20, 12)],
            3 / 4,  # flow-GRPO's reward server: [1, 1, 0.0, 1.0] (a failed relation adds 0 then 1)
            0,
            0,
        ),
        ("a photo of a red circle", [Placed("blue", "circle", 5, 20, 12)], 0.5, 0, 0),
        (
            "a photo of a red circle and a blue square",
            [Placed("red", "circle", 5, 20, 12), Placed("blue", "square", 40, 20, 12)],
            1,
            1,
            1,
        ),
        ("a photo of a triangle and a square", [Placed("red", "triangle", 5, 20, 12)], 0.5, 0, 0),
    ],
)
def test_shapeworld_twin_scores_drawn_scenes(caption, objects, partial, strict, correct):
    out = GenEval(detector="shapeworld")(scene(*objects), [caption])
    assert out["geneval_partial"].item() == pytest.approx(partial)
    assert (out["geneval_strict"].item(), out["geneval_correct"].item()) == (strict, correct)
    assert out["geneval"].item() == pytest.approx(partial)  # the default optimises flow-GRPO's partial credit


def test_per_clause_partial_gives_a_failed_relation_one_clause():
    objects = [Placed("red", "circle", 40, 20, 12), Placed("blue", "square", 5, 20, 12)]
    caption = "a photo of a circle left of a square"
    reward = GenEval(detector="shapeworld", partial="per_clause")
    assert reward(scene(*objects), [caption])["geneval_partial"].item() == pytest.approx(2 / 3)
    with pytest.raises(rewards.RewardArgsError, match="partial must be one of flow_grpo, per_clause"):
        rewards.build("geneval", detector="shapeworld", partial="reference")


def test_shapeworld_detections_carry_the_drawn_objects_masks():
    from rewards.geneval_models import ShapeWorldDetector
    from rewards.shapeworld.render import shape_mask

    objects = [Placed("red", "triangle", 4, 6, 20), Placed("blue", "circle", 34, 30, 24)]
    found = ShapeWorldDetector()(scene(*objects), ["triangle", "circle"])[0]
    for o in objects:
        (f,) = found[o.shape]
        drawn = np.zeros((64, 64), dtype=bool)
        drawn[o.y : o.y + o.size, o.x : o.x + o.size] = shape_mask(o.shape, o.size)
        assert np.array_equal(f.mask.numpy(), drawn) and f.colour == o.colour


def test_each_box_is_coloured_once_for_both_rule_sets():
    reward = GenEval(detector="shapeworld")
    asked = []
    known = reward.colours
    reward.colours = lambda image, found, cls: asked.extend(found) or known(image, found, cls)
    out = reward(
        scene(Placed("red", "circle", 5, 5, 12), Placed("red", "square", 40, 40, 12)),
        ["a photo of a red circle and a red square"],
    )
    assert out["geneval_correct"].item() == 1.0 and out["geneval_strict"].item() == 1.0
    assert len(asked) == 2  # one circle, one square: not once per rule set


def test_metadata_lines_are_scored_from_include_and_exclude(tmp_path):
    """As flow_grpo's reward server scores (it reads ``include`` / ``exclude``, never the
    caption): a line whose wording GenEval's templates do not cover scores exactly as the
    template caption of the same metadata, and the exclude clause counts."""
    from diffrl.data.prompts import load_prompts

    line = {"tag": "counting", "include": [{"class": "circle", "count": 2}],
            "exclude": [{"class": "circle", "count": 3}], "prompt": "Two round things, please!"}  # fmt: skip
    path = tmp_path / "meta.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (prompt,) = load_prompts(path)
    assert prompt == "Two round things, please!" and prompt.metadata == line
    assert pickle.loads(pickle.dumps(prompt)).metadata == line  # survives gather_object
    reward = GenEval(detector="shapeworld")
    reward.check_prompts([prompt])
    rewards.prompt_checker("geneval", detector="shapeworld")([prompt])  # no weights needed
    with pytest.raises(rules.CaptionError):
        reward.check_prompts([str(prompt)])  # the caption alone is no task
    two = scene(Placed("red", "circle", 5, 5, 12), Placed("blue", "circle", 40, 40, 12))
    three = scene(*[Placed("red", "circle", x, 5, 12) for x in (2, 24, 46)])
    for image in (two, three):
        by_metadata = reward(image, [prompt])
        by_caption = reward(image, ["a photo of two circles"])
        assert {k: v.item() for k, v in by_metadata.items()} == {k: v.item() for k, v in by_caption.items()}
    assert reward(two, [prompt])["geneval_correct"].item() == 1.0
    assert reward(three, [prompt])["geneval_correct"].item() == 0.0  # exclude: fewer than 3
    bad = AnnotatedPrompt("p", {"include": [{"class": "dog", "count": 1}]})  # not a ShapeWorld class
    with pytest.raises(rules.CaptionError, match="class 'dog'"):
        reward.check_prompts([bad])


def test_captions_are_checked_up_front_and_score_zero_inside_a_run():
    reward = rewards.build("geneval", detector="shapeworld", score="geneval")
    reward.check_prompts(["a photo of two circles"])
    with pytest.raises(rules.CaptionError, match=r"1 prompt\(s\).*'two red circles'"):
        reward.check_prompts(["a photo of two circles", "two red circles"])
    out = reward(scene(Placed("red", "circle", 5, 5, 12)), ["two red circles"])
    assert out["geneval"].item() == 0.0
