"""The decision-depth probe against a model whose answer is a formula, and its script."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffrl.evaluation.decision_depth import (
    DepthCurve,
    between_sibling_variance,
    decided_by,
    probe,
    recommend,
)
from diffrl.sampling.sde import step_mean_std
from tests.helpers import load_script


class _Rows:
    def select(self, rows):
        return self


class _StillAdapter:
    """A one-number latent whose velocity is 0: every ODE step keeps it, and the step at k
    adds std_k * noise (times a mean factor that is the same for every sibling), so the
    final value's between-sibling variance is exactly std_k^2."""

    device = torch.device("cpu")

    def sigmas(self, n):
        return torch.linspace(1.0, 0.0, n + 1)

    def latent_shape(self):
        return (1,)

    def encode_prompts(self, prompts):
        return _Rows()

    def velocity(self, transformer, x, sigma, cond):
        return torch.zeros_like(x)

    def decode(self, latents):
        return latents


def _final_value(images, prompts):
    return (images.reshape(-1),)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_variance_at_each_step_is_that_step_s_transition_variance(sde_type):
    steps, level = 5, 0.7
    curve = probe(
        _StillAdapter(), None, _final_value, ["a"] * 4, steps, sde_type, level,
        children=4000, batch=10**6, seed=0, log=lambda _: None,
    )  # fmt: skip
    sigmas = _StillAdapter().sigmas(steps)
    x = torch.ones(1, 1)
    for k in range(steps):
        _, std, _ = step_mean_std(
            sde_type, x, torch.zeros_like(x), sigmas[k], sigmas[k + 1], level, float(sigmas[1])
        )
        expected = float(std) ** 2
        # the sample variance of n normal draws has relative s.d. sqrt(2 / (n - 1)); 16000 draws
        tolerance = max(4 * expected * math.sqrt(2 / (4 * 3999)), 1e-12)
        assert abs(curve.variance[k] - expected) <= tolerance, (k, curve.variance[k], expected)
    assert max(curve.variance) > 0.01  # the check can fail
    assert curve.cumulative_share[-1] == pytest.approx(1.0)


def test_recommend_puts_splits_at_the_largest_steps_and_the_window_on_the_densest_run():
    variance = [0.05, 0.10, 0.40, 0.30, 0.05, 0.10, 0.0, 0.0]
    curve = DepthCurve(variance, [0.0] * 8, [0.5] * 8, prompts=4, children=4, noise_level=0.7, sde_type="sde")
    advice = recommend(curve, splits=2, window=3)
    assert advice.split_steps == [2, 3]
    assert advice.split_share == pytest.approx(0.70)
    assert advice.window == (1, 4)  # 0.10 + 0.40 + 0.30 beats every other run of three
    assert advice.window_share == pytest.approx(0.80)
    assert advice.steps_for_80 == 3  # 0.40 + 0.30 = 0.70 < 0.8; + 0.10 reaches it
    assert any("--set tree.split_steps=[2,3]" in line for line in advice.lines())


def _final_value_with_parts(images, prompts):
    """The total is the final value; ``late`` repeats it, ``half`` is defined only for
    the odd children (NaN for the even ones), and ``fixed`` never varies."""
    value = images.reshape(-1)
    odd = torch.arange(value.numel()) % 2 == 1
    parts = {"late": value, "half": torch.where(odd, value, torch.nan), "fixed": torch.ones_like(value)}
    return value, value[:, None], parts


def test_named_parts_are_measured_per_step_leaving_undefined_children_out():
    curve = probe(
        _StillAdapter(), None, _final_value_with_parts, ["a"] * 3, 4, "sde", 0.7,
        children=400, batch=10**6, seed=1, scores=("late", "half", "fixed"), log=lambda _: None,
    )  # fmt: skip
    assert curve.scores["late"] == pytest.approx(curve.variance)
    # half of the children: the same variance, estimated from 200 draws per prompt
    for got, want in zip(curve.scores["half"], curve.variance):
        assert got == pytest.approx(want, rel=4 * math.sqrt(2 / (3 * 199)))
    assert curve.scores["fixed"] == [0.0] * 4
    assert curve.score_share("late") == pytest.approx(curve.share)
    assert DepthCurve.from_dict(curve.as_dict()).scores == curve.scores
    with pytest.raises(ValueError, match="logs no 'typo'.*'fixed', 'half', 'late'"):
        probe(
            _StillAdapter(), None, _final_value_with_parts, ["a"], 2, "sde", 0.7,
            children=2, scores=("typo",), log=lambda _: None,
        )  # fmt: skip


def test_between_sibling_variance_leaves_nan_out_and_matches_the_textbook_variance():
    values = torch.tensor(
        [[1.0, 2.0, 4.0, float("nan")], [3.0, float("nan"), float("nan"), 5.0], [7.0] + [float("nan")] * 3]
    )
    mean, error = between_sibling_variance(values)
    first, second = (
        torch.tensor([1.0, 2.0, 4.0]).var(),
        torch.tensor([3.0, 5.0]).var(),
    )  # the third row has one
    assert mean == pytest.approx(float(first + second) / 2)
    assert error == pytest.approx(float(torch.stack([first, second]).std() / math.sqrt(2)))
    assert math.isnan(between_sibling_variance(torch.tensor([[1.0, float("nan")]]))[0])


def test_decided_by_is_the_first_step_whose_cumulative_share_reaches_the_fraction():
    shares = [0.1, 0.3, 0.2, 0.4]
    assert [decided_by(shares, f) for f in (0.1, 0.4, 0.5, 0.6, 0.61, 1.0)] == [0, 1, 2, 2, 3, 3]


def test_fewer_than_two_children_is_one_clear_error():
    with pytest.raises(ValueError, match="children must be at least 2"):
        probe(_StillAdapter(), None, _final_value, ["a"], 3, "sde", 0.7, children=1, log=lambda _: None)


def test_the_script_writes_the_curve_and_a_plot(tmp_path):
    main = load_script("probe_decision_depth").main
    out = tmp_path / "probe"
    assert (
        main(["--config", "tiny_toy_flowgrpo", "--prompts", "2", "--children", "2", "--out", str(out)]) == 0
    )
    record = json.loads((out / "probe.json").read_text())
    assert len(record["variance"]) == record["num_steps"] == len(record["cumulative_share"])
    assert (out / "probe.png").stat().st_size > 1000
    assert record["recommendation"]["sde_window"][1] <= record["num_steps"]
    assert record["scores"] == {}  # no parts asked for
    parts = tmp_path / "parts"
    args = ["--config", "tiny_toy_flowgrpo", "--prompts", "2", "--children", "2", "--out", str(parts)]
    assert main([*args, "--scores", "shapeworld_strict", "shapeworld_partial"]) == 0
    by_part = json.loads((parts / "probe.json").read_text())["scores"]
    assert sorted(by_part) == ["shapeworld_partial", "shapeworld_strict"]
    assert all(len(v) == record["num_steps"] for v in by_part.values())
    assert (parts / "probe.png").stat().st_size > 1000
    # a written probe reads back as the same curve, and --compare puts probes side by side
    curve = DepthCurve.from_dict(record)
    assert curve.cumulative_share == pytest.approx(record["cumulative_share"])
    assert (
        main(
            ["--compare", f"a={out / 'probe.json'}", f"b={out / 'probe.json'}", "--out", str(tmp_path / "c")]
        )
        == 0
    )
    assert (tmp_path / "c" / "compare.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="LABEL=PATH/probe.json"):
        main(["--compare", str(out / "probe.json"), "--out", str(tmp_path / "c")])
