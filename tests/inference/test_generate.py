"""The one generate-and-score loop (diffrl.inference.generate): its process layout, and
that every caller's sample is the same image from the same key."""

from __future__ import annotations

import torch

from diffrl.inference.generate import GenerationSettings, dealt_chunks, generate_and_score, plan_samples
from diffrl.inference.session import Session
from tests.helpers import quick_config


def test_chunks_are_dealt_so_every_batch_is_one_process_s():
    one = [c for c, _ in dealt_chunks(11, 3, 0, 1)]
    dealt = [dealt_chunks(11, 3, r, 2) for r in range(2)]
    assert sorted(c for d in dealt for c, pad in d if not pad) == one
    assert [c for c, _ in dealt[0]] == [one[0], one[2]]
    # 4 chunks over 3 processes: the last chunk is repeated (as padding) until each has 2
    three = [dealt_chunks(11, 3, r, 3) for r in range(3)]
    assert [len(d) for d in three] == [2, 2, 2]
    assert [pad for d in three for _, pad in d].count(True) == 2


def test_a_sample_is_the_same_image_whatever_else_is_generated_beside_it(tmp_path):
    """The key (tag, prompt index, seed) fixes the noise: the same chunk of a plan, alone
    and in a larger plan, is the same pixels and scores; in another batch it is the same
    image up to the float rounding of another batch shape."""
    session = Session(quick_config("tiny_toy_flowgrpo", tmp_path, "rollout.batch_size=3"))
    settings = GenerationSettings.of(session.cfg)
    prompts = session.read_prompts(session.cfg.data.eval_prompts)[:3]
    plan = plan_samples(prompts, [0, 1], "eval")
    together = generate_and_score(session, plan, settings, keep_image=lambda p: True)
    assert [x.sample for x in together] == plan and [x.position for x in together] == list(range(6))
    assert together[0].thumbnail is None and together[0].scores.keys() == together[5].scores.keys()
    second = generate_and_score(session, plan[3:], settings, keep_image=lambda p: True)  # chunk 2 alone
    for a, b in zip(second, together[3:]):
        assert torch.equal(a.image, b.image) and _same(a.scores, b.scores)
    alone = generate_and_score(session, plan[4:5], settings, keep_image=lambda p: True, encode_alone=True)
    torch.testing.assert_close(alone[0].image, together[4].image, atol=1e-5, rtol=0)


def _same(a: dict, b: dict) -> bool:
    """Equal scores, NaN (a score that does not apply) equal to NaN."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)


def test_a_rendered_sample_is_conditioned_on_its_rendering_and_judged_against_its_prompt(tmp_path):
    """A paraphrase (or a refiner's rewrite) is the image of its rendered text from the
    sample's key, and the reward scores that image against the sample's own prompt."""
    from diffrl.inference.generate import Sample

    session = Session(quick_config("tiny_toy_flowgrpo", tmp_path))
    settings = GenerationSettings.of(session.cfg)
    key = ("eval", 0, 0)
    rendered = Sample(0, "a red circle", 0, key, rendered="two blue squares")
    direct = Sample(0, "two blue squares", 0, key)
    a, b = generate_and_score(session, [rendered, direct], settings, keep_image=lambda p: True)
    assert torch.equal(a.image, b.image)
    _, _, logs = session.reward_fn(a.image.unsqueeze(0), ["a red circle"], {"keys": [key]})
    assert _same(a.scores, {name: float(v[0]) for name, v in logs.items()})
