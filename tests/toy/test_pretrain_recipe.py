"""The pretraining recipe of the toy: position captions (drawn where they say, checked by the
verifier's own detector), the sigma density (against its closed-form CDF), the curriculum's
stages, and the command line's one-line errors."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from diffrl.models.toy import word_tokenizer
from diffrl.toy import positions
from diffrl.toy.recipe import SigmaDensity, parse_curriculum, parse_density, stage_at
from rewards.shapeworld import detect, grammar

KINDS = ("count", "pair", "relation", "position")


def _pixels(images: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255


def test_position_captions_are_in_the_vocabulary_and_leave_the_heldout_counts_out():
    tok = word_tokenizer()
    held_counts, _ = grammar.heldout_combinations()
    every = positions.captions(exclude_heldout_counts=False)
    assert len(every) == 18 * 4 and len(set(every)) == 72
    kept = positions.captions()
    for caption in every:
        spec = positions.parse(caption)
        assert spec.caption() == caption and tok.unk_token_id not in tok(caption).input_ids
        # an object whose one-object prompt ("a red circle") is held out is never drawn alone
        assert (caption in kept) == ((1, spec.colour, spec.shape) not in held_counts)
    assert len(kept) == 4 * (18 - sum(1 for n, *_ in held_counts if n == 1))
    # no position caption is a grammar prompt, and no grammar prompt parses as a position
    assert all(positions.parse(s.caption()) is None for s in grammar.all_specs())


@pytest.mark.parametrize("grid", [8, None])
def test_position_renders_put_the_one_object_in_the_named_half(grid):
    rnd = random.Random(0)
    specs = [positions.parse(c) for c in positions.captions(exclude_heldout_counts=False)] * 3
    found = detect(_pixels([positions.render(s, rnd, 32, grid) for s in specs]))
    xs = {p: [] for p in positions.POSITIONS}
    for spec, dets in zip(specs, found):
        assert [(d.colour, d.shape) for d in dets] == [(spec.colour, spec.shape)]
        cx, cy = dets[0].cx, dets[0].cy
        assert {"to the left": cx < 16, "to the right": cx > 16, "above": cy < 16, "below": cy > 16}[
            spec.position
        ]
        xs[spec.position].append(cx)
    # uniform within the half: both columns of the left half occur, and "above" uses the whole width
    assert len(set(xs["to the left"])) > 1 and min(xs["above"]) < 16 < max(xs["above"])


def test_corrupted_position_scenes_break_exactly_one_thing():
    rnd = random.Random(1)
    changed = set()
    for caption in positions.captions():
        spec = positions.parse(caption)
        bad = positions.corrupt(spec, rnd)
        diffs = [f for f in ("colour", "shape", "position") if getattr(bad, f) != getattr(spec, f)]
        assert len(diffs) == 1
        changed.add(diffs[0])
        if diffs == ["position"]:
            assert bad.position == positions.OPPOSITE[spec.position]
    assert changed == {"colour", "shape", "position"}


def test_one_component_density_draws_what_the_logit_normal_always_drew():
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    expected = torch.sigmoid(torch.randn(64, generator=gen_a) + 1.5)
    assert torch.equal(SigmaDensity((1.5,)).sample(64, gen_b), expected)


def test_mixture_density_matches_its_closed_form_cdf():
    density = parse_density("2.5,0", "0.3,0.7")
    sigmas = density.sample(200_000, torch.Generator().manual_seed(0))
    normal = torch.distributions.Normal(0.0, 1.0)
    for t in (0.2, 0.5, 0.8, 0.95):
        logit = torch.logit(torch.tensor(t))
        cdf = 0.3 * normal.cdf(logit - 2.5) + 0.7 * normal.cdf(logit)
        assert abs(float((sigmas <= t).float().mean()) - float(cdf)) < 0.004  # binomial sd <= 0.0012
        assert abs(density.share_above(t) - (1 - float(cdf))) < 1e-6


def test_curriculum_stages_and_the_step_each_belongs_to():
    stages = parse_curriculum("0,0,0,1@1500 ~2.5; 0,0,1,1@500; 1,1,2,1~2.5,0/0.7,0.3", KINDS)
    assert [s.kind_weights for s in stages] == [(0, 0, 0, 1), (0, 0, 1, 1), (1, 1, 2, 1)]
    assert [s.steps for s in stages] == [1500, 500, None]
    assert stages[0].density == SigmaDensity((2.5,), (1.0,)) and stages[1].density is None
    assert stages[2].density == SigmaDensity((2.5, 0.0), (0.7, 0.3))
    assert [stage_at(stages, s) for s in (1, 1500, 1501, 2000, 2001, 10**6)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    "text",
    ["0,0,1@100; 1,1,1,1", "0,0,0,1; 1,1,1,1", "0,0,0,1@100; 1,1,1,1@50", "0,0,0,1@0; 1,1,1,1", "1,1,1,1~x"],
)
def test_bad_curriculum_is_one_error_naming_the_stage(text):
    with pytest.raises(ValueError, match="--curriculum stage '"):
        parse_curriculum(text, KINDS)


def test_each_step_draws_its_stage_kinds(tmp_path):
    from diffrl.toy.pretrain import PretrainConfig, captions_by_kind, training_batch, training_stages

    cfg = PretrainConfig(batch_size=32, caption_dropout=0.0, curriculum="0,0,0,1@2; 0,0,1,0@1; 1,1,1,1")
    stages, by_kind = training_stages(cfg), captions_by_kind()
    kinds = []
    for step in (1, 2, 3, 4):
        images, captions = training_batch(cfg, by_kind, stages[stage_at(stages, step)], step)
        assert images.shape == (32, 3, 32, 32)
        kinds.append({(positions.parse(c) or grammar.parse(c)).kind for c in captions})
    assert kinds[:3] == [{"position"}, {"position"}, {"relation"}]
    assert kinds[3] == {"count", "pair", "relation", "position"}
    # a stage without its own density takes the run's
    assert stages[0].density == parse_density(cfg.sigma_location)


def test_pretrain_script_errors_for_the_recipe_flags_are_one_line(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_toy.py"
    spec = importlib.util.spec_from_file_location("pretrain_toy", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--curriculum", "0,0,1,0", "--sigma-location", "1,x", "--out", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --sigma-location must be") and err.count("\n") == 1
    assert script.main(["--curriculum", "0,0,1@5; 1,1,1,1", "--out", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --curriculum stage '0,0,1@5'") and err.count("\n") == 1


def test_position_probe_reads_the_half_from_pixels_as_the_renderer_drew_it():
    from diffrl.toy import relation_probe as probe

    rnd = random.Random(2)

    def renderer(captions, **_):  # a "model" that draws every caption exactly as asked
        return _pixels([positions.render(positions.parse(c), rnd, 32, 8) for c in captions])

    rows = probe.position_placement(renderer)
    assert {p: rows[p]["n"] for p in positions.POSITIONS} == dict.fromkeys(positions.POSITIONS, 18)
    assert rows["to the left"]["left_half"] == 1.0 and rows["to the right"]["left_half"] == 0.0
    assert rows["above"]["top_half"] == 1.0 and rows["below"]["top_half"] == 0.0

    def ignores_the_word(captions, **_):  # every object drawn on the left, whatever the caption says
        return _pixels(
            [
                positions.render(dataclasses.replace(positions.parse(c), position="to the left"), rnd, 32, 8)
                for c in captions
            ]
        )

    rows = probe.position_placement(ignores_the_word)
    assert rows["to the left"]["left_half"] == rows["to the right"]["left_half"] == 1.0


class _DrawingModel:
    """A stand-in for a toy pipeline whose x0 prediction from any noise is a render of the
    caption (with its position word replaced by ``always``, when given)."""

    def __init__(self, always: str | None = None):
        self.transformer = type("T", (), {"config": type("C", (), {"sample_size": 32})()})()
        self.always, self.rnd = always, random.Random(3)

    def text_embeddings(self, captions):
        return captions, None

    def velocity(self, x, sigma, captions, _pooled):
        specs = [positions.parse(c) for c in captions]
        if self.always:
            specs = [dataclasses.replace(s, position=self.always) for s in specs]
        x0 = _pixels([positions.render(s, self.rnd, 32, 8) for s in specs]) * 2 - 1
        return (x - x0) / sigma.view(-1, 1, 1, 1)  # x_t = x0 + sigma v


def test_position_mass_is_one_for_a_model_that_reads_the_word_and_splits_for_one_that_does_not():
    from diffrl.toy import relation_probe as probe

    reads = probe.position_mass(_DrawingModel())
    assert all(abs(v - 1.0) < 1e-6 for v in reads.values())
    deaf = probe.position_mass(_DrawingModel(always="to the left"))
    assert abs(deaf["to the left"] - 1.0) < 1e-6 and abs(deaf["to the right"]) < 1e-6
    # a vertical word the model ignores: its objects land in random rows, about half on top
    assert 0.2 < deaf["above"] < 0.8 and 0.2 < deaf["below"] < 0.8


def test_the_default_is_the_curriculum_and_kind_weights_replace_it_with_one_stage():
    from diffrl.toy.pretrain import RECIPE, PretrainConfig, training_stages

    default = training_stages(PretrainConfig())
    assert [s.kind_weights for s in default] == [w.kind_weights for w in parse_curriculum(RECIPE, KINDS)]
    assert [s.steps for s in default] == [1500, 1500, None]
    assert default[0].density.locations == (2.5,) and default[-1].density.locations == (1.0,)
    single = training_stages(PretrainConfig(kind_weights="0,0,1", sigma_location="1.5"))
    assert len(single) == 1 and single[0].kind_weights == (0, 0, 1, 0)
    assert single[0].density.locations == (1.5,)
    # with the curriculum emptied the three grammar kinds are drawn equally (the old recipe)
    old = training_stages(PretrainConfig(curriculum=""))
    assert old[0].kind_weights == (1, 1, 1, 0)
