"""The ``random_control`` reward: uniform, prompt-blind, and the same for the same sample."""

from __future__ import annotations

import torch

import rewards


def test_scores_repeat_for_the_same_sample_and_ignore_the_prompt():
    reward = rewards.build("random_control")
    images = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    first = reward(images, ["a red circle"] * 6)["random_control"]
    again = reward(images.clone(), ["something else entirely"] * 6)["random_control"]
    assert torch.equal(first, again)
    assert first.unique().numel() == 6
    other_seed = rewards.build("random_control", seed=1)(images)["random_control"]
    assert not torch.equal(first, other_seed)
    clips = torch.rand(3, 4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    assert reward(clips)["random_control"].shape == (3,)


def test_scores_are_uniform_and_unrelated_to_brightness():
    """2000 samples: every decile holds 200 +- 5 sd (sd = sqrt(2000 * 0.1 * 0.9) = 13.4),
    and the correlation with mean brightness is within 4 / sqrt(2000) of 0."""
    images = torch.rand(2000, 3, 4, 4, generator=torch.Generator().manual_seed(2))
    scores = rewards.build("random_control")(images)["random_control"]
    assert ((scores >= 0) & (scores < 1)).all()
    counts = torch.histc(scores, bins=10, min=0.0, max=1.0)
    assert (counts - 200).abs().max() < 5 * 13.4
    brightness = images.mean(dim=(1, 2, 3))
    corr = torch.corrcoef(torch.stack([scores, brightness]))[0, 1]
    assert abs(float(corr)) < 4 / 2000**0.5
