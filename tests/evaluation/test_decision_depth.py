"""The decision-depth probe against a model whose answer is a formula, and its script."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffrl.evaluation.decision_depth import DepthCurve, probe, recommend
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
