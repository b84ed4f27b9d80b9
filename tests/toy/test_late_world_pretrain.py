"""Pretraining the late-step world's base: captions, texture-only noise, new words."""

import random

import torch

from diffrl.models import tiny
from diffrl.models.toy import ToyPipeline, build_components
from diffrl.toy import late_world
from diffrl.toy.pretrain import PretrainConfig, pretrain, training_batch, training_stages
from rewards.shapeworld import ShapeWorldVerifier, grammar


def test_flipping_a_texture_breaks_only_the_texture_clause():
    rnd = random.Random(0)
    for prompt in grammar.late_split()[0][:200]:
        spec = grammar.parse(prompt)
        flipped = late_world.flip_texture(spec, rnd)
        changed = [(a, b) for a, b in zip(spec.groups, flipped.groups) if a != b]
        assert len(changed) == 1
        ((a, b),) = changed
        assert (a.count, a.colour, a.shape) == (b.count, b.colour, b.shape) and a.texture != b.texture


def test_a_late_batch_shows_its_captions_or_their_texture_flipped():
    """With caption noise 0.5 every image keeps its shapes (so the base learns them from
    every caption) while about half show a wrong texture."""
    cfg = PretrainConfig(world="late", batch_size=64, caption_dropout=0.0, caption_noise=0.5)
    images, captions = training_batch(cfg, late_world.captions_by_kind(), training_stages(cfg)[0], 1)
    scores = ShapeWorldVerifier()((images + 1) / 2, captions)
    assert scores["shapeworld_clause/shapes"].mean() == 1.0
    assert 0.25 < scores["shapeworld_strict"].mean() < 0.75
    assert {grammar.parse(c).kind for c in captions} == {"count", "pair"}


def test_the_texture_words_join_the_vocabulary_without_moving_any_old_word():
    with tiny.seeded(0):
        pipe = ToyPipeline(**build_components(layers=1, heads=1, text_layers=1), prediction="x0")
    prompts = ["a red circle and a blue square", "three green triangles"]
    before_ids = pipe.tokenizer(prompts, padding="max_length")["input_ids"]
    before = pipe.encode_prompt(prompts, False)[0]
    late_world.read_texture_words(pipe)
    assert pipe.tokenizer(prompts, padding="max_length")["input_ids"] == before_ids
    torch.testing.assert_close(pipe.encode_prompt(prompts, False)[0], before)  # old prompts unchanged
    ids = pipe.tokenizer(["a striped red circle", "a solid red circle"])["input_ids"]
    assert ids[0][2] != ids[1][2] and pipe.tokenizer.unk_token_id not in ids[0] + ids[1]
    late_world.read_texture_words(pipe)  # a second call changes nothing
    assert pipe.text_encoder.get_input_embeddings().weight.shape[0] == len(pipe.tokenizer.get_vocab())


def test_a_late_world_pretraining_run_saves_a_model_that_reads_textures(tmp_path):
    out = tmp_path / "late"
    cfg = PretrainConfig(
        world="late", out=str(out), steps=2, batch_size=4, eval_every=2, eval_prompts=2, eval_steps=2
    )
    summary = pretrain(cfg, log=lambda _: None)
    assert "heldout_shapes_g1" in summary["history"][-1]
    pipe = ToyPipeline.from_pretrained(out)
    assert "striped" in pipe.tokenizer.get_vocab()
