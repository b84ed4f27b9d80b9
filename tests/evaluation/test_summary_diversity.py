"""Diversity metric (evaluation) and the before/after table (summary)."""

import json
import math

import torch

from diffrl.data.prompts import spaced_subset
from diffrl.evaluation.scoring import diversity, standard_error, thumbnails
from diffrl.evaluation.summary import before_after


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
    _write(
        path,
        [
            {
                "step": 0,
                "wall_time": 1.0,
                "eval/r/mean": 0.5,
                "eval/r_strict/mean": 0.25,
                "eval/diversity": 0.2,
            },
            {"step": 1, "wall_time": 2.0, "reward/mean": 0.1},
            {
                "step": 5,
                "wall_time": 60.0,
                "eval/r/mean": 0.7,
                "eval/r_strict/mean": 0.5,
                "eval/diversity": 0.1,
            },
            {
                "step": 10,
                "wall_time": 120.0,
                "eval/r/mean": 0.9,
                "eval/r_strict/mean": 0.75,
                "eval/diversity": 0.15,
            },
        ],
    )
    table = before_after(path, ("eval/r_strict/mean", "eval/r/mean")).splitlines()
    assert "step 0" in table[0] and "step 10" in table[0]
    assert table[1].startswith("held-out prompts")
    assert table[2].startswith("* eval/r_strict/mean") and table[2].split()[-3:] == ["0.25", "0.75", "+0.500"]
    assert [line.split()[-1] for line in table[3:5]] == ["0.75x", "+0.400"]  # diversity, r
    assert "wall time 2.0 min" in table[-1]


def test_before_after_shows_counts_standard_errors_training_prompts_and_fidelity_ratios(tmp_path):
    path = tmp_path / "metrics.jsonl"
    row = {
        "eval/n": 660,
        "eval/s/mean": 0.2,
        "eval/s/se": 0.016,
        "eval/fidelity/dark/mean": 0.001,
        "eval/fidelity/dark/se": 0.0000234,
        "eval_train/n": 256,
        "eval_train/s/mean": 0.3,
        "eval_train/s/se": 0.02,
    }
    later = {
        **row,
        "eval/s/mean": 0.7,
        "eval/s/se": 0.018,
        "eval/fidelity/dark/mean": 0.0015,
        "eval_train/s/mean": 0.8,
    }
    _write(path, [{"step": 0, **row}, {"step": 50, **later}])
    table = before_after(path, ("eval/s/mean",))
    lines = table.splitlines()
    held = lines.index("held-out prompts (n = 660 / 660 samples)")
    train = lines.index("training prompts (n = 256 / 256 samples)")
    assert held < train
    assert lines[held + 1].split() == ["*", "eval/s/mean", "0.2", "±", "0.016", "0.7", "±", "0.018", "+0.500"]
    fidelity = next(line for line in lines if "eval/fidelity/dark/mean" in line)
    assert fidelity.split()[-1] == "1.50x"
    assert fidelity.split()[1:4] == ["0.001", "±", "2.3e-05"]  # a small standard error keeps its digits
    assert lines[train + 1].split()[-1] == "+0.500"
    assert (
        "/se" not in table and "eval/n " not in table
    )  # standard errors and counts are not rows of their own


def test_before_after_needs_two_evaluations(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 0, "eval/r/mean": 0.5}])
    assert "fewer than two evaluations" in before_after(path)
    assert "fewer than two evaluations" in before_after(tmp_path / "missing.jsonl")


def test_standard_error_is_taken_over_per_prompt_means():
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5])
    prompt_index = [0, 0, 1, 1, 2, 2, 3, 3]
    means = [0.5, 1.0, 0.0, 0.75]
    mu = sum(means) / 4
    want = math.sqrt(sum((m - mu) ** 2 for m in means) / 3) / math.sqrt(4)
    assert math.isclose(standard_error(values, prompt_index), want, rel_tol=1e-12)
    assert math.isnan(standard_error(values[:2], [0, 0]))
    # NaN means "does not apply": the same as leaving those samples out
    holes = torch.cat([values, torch.tensor([float("nan")] * 3)])
    assert standard_error(holes, prompt_index + [0, 1, 7]) == standard_error(values, prompt_index)


def test_spaced_subset_is_even_and_fixed():
    prompts = [f"p{i}" for i in range(10)]
    assert spaced_subset(prompts, 5) == ["p0", "p2", "p4", "p6", "p8"]
    assert spaced_subset(prompts, 3) == ["p0", "p3", "p6"]
    assert spaced_subset(prompts, 20) == prompts


def test_before_after_keeps_long_cells_apart(tmp_path):
    """A long key with long 'value ± se' cells (the shipped configs' training-prompt
    darkness) must still split into separate columns."""
    path = tmp_path / "metrics.jsonl"
    key = "eval_train/fidelity/background_darkness"
    _write(
        path,
        [
            {"step": 0, "eval/s/mean": 0.2, f"{key}/mean": 0.002221, f"{key}/se": 2.4e-06},
            {"step": 100, "eval/s/mean": 0.3, f"{key}/mean": 0.009998, f"{key}/se": 5.3e-06},
        ],
    )
    row = next(line for line in before_after(path).splitlines() if key in line)
    assert row.split() == [f"{key}/mean", "0.002221", "±", "2.4e-06", "0.009998", "±", "5.3e-06", "4.50x"]
    assert "  0.002221" in row and "e-06  0.009998" in row
