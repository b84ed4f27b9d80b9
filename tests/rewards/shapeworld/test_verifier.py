"""The ShapeWorld verifier against rendered ground truth, and its pieces against references."""

import random
from collections import deque

import numpy as np
import pytest
import torch

import rewards
from rewards.images import RewardInputError
from rewards.shapeworld import ShapeWorldVerifier, classify_shape, connected_components, detect, grammar
from rewards.shapeworld.render import Placed, corrupt, draw, render, shape_mask


def _batch(images):
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255


def _sample_prompts(n, seed=0):
    train, heldout = grammar.split()
    return random.Random(seed).sample(train + heldout, n)


@pytest.mark.parametrize(
    "resolution, grid", [(32, None), (48, None), (32, 8)], ids=["32px", "48px", "32px-lattice"]
)
def test_accuracy_on_correct_and_deliberately_wrong_renders(resolution, grid):
    rnd = random.Random(resolution)
    prompts = _sample_prompts(400, seed=resolution)
    verifier = rewards.build("shapeworld")
    good = verifier(_batch([render(grammar.parse(p), rnd, resolution, grid) for p in prompts]), prompts)
    bad = verifier(
        _batch([render(corrupt(grammar.parse(p), rnd), rnd, resolution, grid) for p in prompts]), prompts
    )
    assert good["shapeworld_strict"].mean() >= 0.98
    assert bad["shapeworld_strict"].mean() <= 0.02
    # a wrong render breaks some clauses but usually not all of them
    assert 0.2 < bad["shapeworld_partial"].mean() < 0.8
    assert torch.equal(good["shapeworld"], good["shapeworld_partial"])


def test_partial_and_strict_follow_the_clauses():
    prompt = "a red circle to the left of a blue square"
    red, blue = Placed("red", "circle", 2, 10, 10), Placed("blue", "square", 20, 10, 10)
    verifier = ShapeWorldVerifier(score="mean")
    meta = {}
    out = verifier(
        _batch(
            [
                draw([red, blue]),
                draw([red.__class__("red", "circle", 20, 10, 10), Placed("blue", "square", 2, 10, 10)]),
                draw([red]),
            ]
        ),
        [prompt] * 3,
        meta,
    )
    assert out["shapeworld_strict"].tolist() == [1.0, 0.0, 0.0]
    assert out["shapeworld_partial"].tolist() == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert out["shapeworld"].tolist() == pytest.approx([1.0, 1 / 3, 1 / 6])
    clauses = meta["shapeworld"][1].clauses
    assert [c["ok"] for c in clauses] == [True, True, False]
    assert clauses[2]["clause"] == prompt
    assert meta["shapeworld"][2].clauses[1]["found"] == 0


def test_breakdown_separates_kinds_objects_and_the_relation_and_is_nan_where_it_does_not_apply():
    relation = "a red circle to the left of a blue square"
    red_left, blue_right = Placed("red", "circle", 2, 10, 10), Placed("blue", "square", 20, 10, 10)
    red_right, blue_left = Placed("red", "circle", 20, 10, 10), Placed("blue", "square", 2, 10, 10)
    images = [
        draw([red_left, blue_right]),
        draw([red_right, blue_left]),
        draw([red_left]),
        draw([Placed("green", "triangle", 4, 4, 8)]),
    ]
    out = ShapeWorldVerifier()(_batch(images), [relation] * 3 + ["a green triangle"])
    nan = float("nan")

    def same(key, want):
        got = out[key].tolist()
        assert len(got) == len(want) and all((g != g and w != w) or g == w for g, w in zip(got, want)), (
            key,
            got,
        )

    same("shapeworld_kind/relation", [1.0, 0.0, 0.0, nan])
    same("shapeworld_kind/count", [nan, nan, nan, 1.0])
    same("shapeworld_kind/pair", [nan] * 4)
    same("shapeworld_clause/objects", [1.0, 1.0, 0.0, 1.0])
    # the swapped image has the right objects in the wrong places; the one-object image
    # has no right objects, so the relation is not asked of it
    same("shapeworld_clause/relation_given_objects", [1.0, 0.0, nan, nan])
    # each per-kind column is strict accuracy restricted to that kind
    for kind, rows in (("relation", [0, 1, 2]), ("count", [3])):
        assert out[f"shapeworld_kind/{kind}"][rows].tolist() == out["shapeworld_strict"][rows].tolist()


def test_count_clause_is_exact():
    prompt = "two green triangles"
    objs = [Placed("green", "triangle", x, 4, 8) for x in (1, 12, 23)]
    out = ShapeWorldVerifier()(_batch([draw(objs[:2]), draw(objs), draw(objs[:1])]), [prompt] * 3)
    assert out["shapeworld_strict"].tolist() == [1.0, 0.0, 0.0]


def test_out_of_grammar_prompt_scores_zero_with_a_reason_and_never_raises():
    meta = {}
    image = _batch([render(grammar.parse("a red circle"), random.Random(0))])
    out = ShapeWorldVerifier()(image, ["a photo of a cat"], meta)
    assert out["shapeworld"].item() == 0.0 and out["shapeworld_strict"].item() == 0.0
    assert "outside the grammar" in meta["shapeworld"][0].reason


def test_check_prompts_names_every_bad_prompt():
    verifier = ShapeWorldVerifier()
    verifier.check_prompts(["a red circle", "two blue squares"])
    with pytest.raises(
        grammar.PromptGrammarError, match="2 prompt\\(s\\) outside the grammar: 'a cat'; 'a dog'"
    ):
        verifier.check_prompts(["a red circle", "a cat", "a dog"])


def test_bad_arguments_and_inputs_are_clear():
    with pytest.raises(ValueError, match="score must be"):
        ShapeWorldVerifier(score="best")
    with pytest.raises(RewardInputError, match="shapeworld scores images"):
        ShapeWorldVerifier()(torch.rand(1, 2, 3, 32, 32), ["a red circle"])


def _bfs_components(labels: np.ndarray) -> int:
    """Reference: count 4-connected equal-label components by breadth-first search."""
    h, w = labels.shape
    seen = np.zeros_like(labels, dtype=bool)
    count = 0
    for y in range(h):
        for x in range(w):
            if labels[y, x] < 0 or seen[y, x]:
                continue
            count += 1
            queue = deque([(y, x)])
            seen[y, x] = True
            while queue:
                cy, cx = queue.popleft()
                for ny, nx in ((cy - 1, cx), (cy + 1, cx), (cy, cx - 1), (cy, cx + 1)):
                    if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and labels[ny, nx] == labels[cy, cx]:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
    return count


def test_connected_components_match_breadth_first_search():
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(-1, 3, (6, 12, 12), generator=gen)
    comp = connected_components(labels)
    for i in range(len(labels)):
        ids = comp[i][comp[i] >= 0]
        assert len(torch.unique(ids)) == _bfs_components(labels[i].numpy())
        # every pixel in a component has the label of the component's root pixel
        roots = labels.flatten()[comp[i][comp[i] >= 0]]
        assert torch.equal(roots, labels[i][comp[i] >= 0])


def test_shape_classifier_on_the_renderer_masks_at_every_size():
    for size in range(6, 25):
        for shape in ("circle", "square", "triangle"):
            assert classify_shape(float(shape_mask(shape, size).mean())) == shape, (shape, size)


def test_detect_finds_centroids_and_ignores_specks():
    image = draw([Placed("cyan", "square", 4, 6, 10)])
    image[30, 30] = (220, 30, 30)  # a one-pixel red speck
    (det,) = detect(_batch([image]))
    assert len(det) == 1
    d = det[0]
    assert (d.colour, d.shape, d.area) == ("cyan", "square", 100)
    assert (d.cx, d.cy) == pytest.approx((9.0, 11.0))


def test_a_prompt_file_outside_the_grammar_fails_at_start_up_with_one_error(tmp_path, capsys):
    from diffrl.cli import main

    bad = tmp_path / "prompts.txt"
    bad.write_text("a red circle\na photo of a cat\n")
    code = main(
        [
            "--config",
            "tiny_toy_flowgrpo",
            "--set",
            f"data.train_prompts={bad}",
            "--set",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(
        f"error: {bad}: shapeworld reward: 1 prompt(s) outside the grammar: 'a photo of a cat'"
    )
    assert "Traceback" not in err and not (tmp_path / "run").exists()
