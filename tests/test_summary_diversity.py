"""Diversity metric (evaluation) and the before/after table (summary)."""

import json
import math

import torch

from diffrl.evaluation import diversity, thumbnails
from diffrl.summary import before_after


def test_diversity_is_the_mean_pairwise_rms_distance_per_prompt():
    gen = torch.Generator().manual_seed(0)
    thumbs = torch.rand(5, 12, generator=gen)
    prompt_index = [0, 0, 0, 1, 1]

    def rms(a, b):
        return math.sqrt(sum((x - y) ** 2 for x, y in zip(a.tolist(), b.tolist())) / len(a))

    p0 = (rms(thumbs[0], thumbs[1]) + rms(thumbs[0], thumbs[2]) + rms(thumbs[1], thumbs[2])) / 3
    p1 = rms(thumbs[3], thumbs[4])
    assert math.isclose(diversity(thumbs, prompt_index), (p0 + p1) / 2, rel_tol=1e-6)


def test_identical_samples_have_zero_diversity_and_single_samples_none():
    same = torch.ones(4, 6)
    assert diversity(same, [0, 0, 1, 1]) == 0.0
    assert math.isnan(diversity(torch.rand(3, 6), [0, 1, 2]))


def test_thumbnails_area_downsample_large_images_and_flatten_video():
    images = torch.rand(2, 3, 128, 96)
    t = thumbnails(images, size=64)
    ref = torch.nn.functional.interpolate(images, size=(64, 48), mode="area").reshape(2, -1)
    assert torch.allclose(t, ref)
    small = torch.rand(2, 3, 32, 32)
    assert torch.equal(thumbnails(small), small.reshape(2, -1))
    video = torch.rand(2, 4, 3, 16, 16)
    assert thumbnails(video).shape == (2, 4 * 3 * 16 * 16)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_before_after_uses_first_and_last_evaluation_and_marks_the_headline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [
        {"step": 0, "wall_time": 1.0, "eval/r/mean": 0.5, "eval/r_strict/mean": 0.25, "eval/diversity": 0.2},
        {"step": 1, "wall_time": 2.0, "reward/mean": 0.1},
        {"step": 5, "wall_time": 60.0, "eval/r/mean": 0.7, "eval/r_strict/mean": 0.5, "eval/diversity": 0.1},
        {"step": 10, "wall_time": 120.0, "eval/r/mean": 0.9, "eval/r_strict/mean": 0.75, "eval/diversity": 0.15},
    ])
    table = before_after(path, ("eval/r_strict/mean", "eval/r/mean")).splitlines()
    assert "step 0" in table[0] and "step 10" in table[0]
    assert table[1].startswith("* eval/r_strict/mean") and table[1].split()[-3:] == ["0.25", "0.75", "+0.500"]
    assert [line.split()[-1] for line in table[2:4]] == ["75%", "+0.400"]  # diversity, r
    assert "wall time 2.0 min" in table[-1]


def test_before_after_needs_two_evaluations(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 0, "eval/r/mean": 0.5}])
    assert "fewer than two evaluations" in before_after(path)
    assert "fewer than two evaluations" in before_after(tmp_path / "missing.jsonl")
