"""The late-step world: textured prompts, renders and the verifier's texture clause."""

import random

import numpy as np
import pytest
import torch

import rewards
from rewards.shapeworld import detect, grammar
from rewards.shapeworld.render import PALETTE, Placed, corrupt, draw, render, textured_colours
from rewards.shapeworld.verifier import SOLID_BELOW, STRIPED_ABOVE, Detection, verify


def _batch(images):
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255


def _late_prompts(n, seed=0):
    train, heldout = grammar.late_split()
    return random.Random(seed).sample(train + heldout, n)


@pytest.mark.parametrize(
    "resolution, grid", [(32, None), (32, 8), (48, None)], ids=["32px", "lattice", "48px"]
)
def test_accuracy_on_correct_and_deliberately_wrong_late_renders(resolution, grid):
    rnd = random.Random(resolution)
    prompts = _late_prompts(300, seed=resolution)
    verifier = rewards.build("shapeworld")
    good = verifier(_batch([render(grammar.parse(p), rnd, resolution, grid) for p in prompts]), prompts)
    bad = verifier(
        _batch([render(corrupt(grammar.parse(p), rnd), rnd, resolution, grid) for p in prompts]), prompts
    )
    assert good["shapeworld_strict"].mean() >= 0.98
    assert bad["shapeworld_strict"].mean() <= 0.02
    assert good["shapeworld_clause/texture_given_shapes"].nanmean() >= 0.98


@pytest.mark.parametrize("colour", list(PALETTE))
@pytest.mark.parametrize("shape", grammar.SHAPES)
@pytest.mark.parametrize("size", [6, 9, 12])
def test_every_colour_shape_and_size_is_detected_with_its_texture(colour, shape, size):
    objects = [Placed(colour, shape, 2, 2, size, "striped"), Placed(colour, shape, 17, 17, size, "solid")]
    found = sorted(detect(_batch([draw(objects)]))[0], key=lambda d: d.cx)
    assert [(d.colour, d.shape, d.texture) for d in found] == [
        (colour, shape, "striped"),
        (colour, shape, "solid"),
    ]
    assert found[0].stripes > STRIPED_ABOVE + 0.05 and abs(found[1].stripes) < SOLID_BELOW / 2


@pytest.mark.parametrize("colour", list(PALETTE))
def test_the_textures_share_their_mean_colour(colour):
    """Averaged over two rows, a striped object is its solid twin: the texture is all in
    the highest vertical frequency, which noise hides until the last denoising steps."""
    striped, solid = (np.array(textured_colours(colour)[t]) for t in ("striped", "solid"))
    np.testing.assert_allclose(striped.mean(0), solid.mean(0), atol=1e-9)
    contrast = np.abs(striped[0] - striped[1]).max() / 255
    assert contrast > STRIPED_ABOVE + 0.05  # while the rows themselves differ clearly
    two_rows = [Placed(colour, "square", 0, 0, 8, t) for t in ("striped", "solid")]
    a, b = (draw([o], 8).astype(float) for o in two_rows)
    np.testing.assert_allclose(a.reshape(4, 2, 8, 3).mean(1), b.reshape(4, 2, 8, 3).mean(1), atol=0.5)


def test_the_texture_clause_gives_partial_credit_and_is_diagnosed_apart():
    prompt = "a striped red circle and a solid blue square"
    right = [Placed("red", "circle", 2, 10, 10, "striped"), Placed("blue", "square", 20, 10, 10, "solid")]
    one_wrong = [Placed("red", "circle", 2, 10, 10, "solid"), Placed("blue", "square", 20, 10, 10, "solid")]
    verifier = rewards.build("shapeworld")
    out = verifier(_batch([draw(right), draw(one_wrong)]), [prompt, prompt])
    assert out["shapeworld_strict"].tolist() == [1.0, 0.0]
    assert out["shapeworld_partial"].tolist() == [1.0, 0.5]
    assert out["shapeworld_clause/shapes"].tolist() == [1.0, 1.0]  # the shapes were right both times
    assert out["shapeworld_clause/texture_given_shapes"].tolist() == [1.0, 0.0]
    # an untextured prompt ignores texture, and has no texture diagnostics
    plain = verifier(_batch([draw(one_wrong)]), ["a red circle and a blue square"])
    assert plain["shapeworld_strict"].tolist() == [1.0]
    assert "shapeworld_clause/texture_given_shapes" not in plain


def test_textured_prompts_parse_and_mixed_ones_are_one_clear_error():
    spec = grammar.parse("two striped green triangles")
    assert spec.groups[0] == grammar.Group(2, "green", "triangle", "striped")
    assert spec.caption() == "two striped green triangles"
    with pytest.raises(grammar.PromptGrammarError, match="to both objects or to neither"):
        grammar.parse("a striped red circle and a blue square")
    assert verify("a striped red circle", []).strict == 0.0


def test_the_late_split_is_disjoint_and_holds_out_whole_object_pairs():
    train, heldout = grammar.late_split()
    assert not set(train) & set(heldout)
    assert len(train) + len(heldout) == len(grammar.late_specs())
    pairs = lambda prompts: {  # noqa: E731
        frozenset(g.thing for g in grammar.parse(p).groups) for p in prompts if " and " in p
    }
    assert not pairs(train) & pairs(heldout)
    assert all(grammar.parse(p).groups[0].texture for p in train + heldout)


def test_half_contrast_stripes_are_neither_texture():
    """A model that hedges between the two textures draws stripes of about half the
    contrast; that satisfies neither word."""
    hedged = Detection("red", "square", 10.0, 10.0, 36, 1.0, stripes=0.11)
    assert hedged.texture == "unclear"
    assert verify("a striped red square", [hedged]).strict == 0.0
    assert verify("a solid red square", [hedged]).strict == 0.0
    assert verify("a red square", [hedged]).strict == 1.0  # an untextured prompt does not care
