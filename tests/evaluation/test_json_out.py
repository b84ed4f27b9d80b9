"""Evaluation JSON is JSON: NaN scores are null (issue 62, item 11)."""

import json
import math

from diffrl.evaluation import json_out


def test_non_finite_values_are_null_at_any_depth_and_strict_parsers_read_it():
    value = {"a": float("nan"), "b": [1.0, float("inf"), {"c": -float("inf")}], "d": (2, "x"), "e": 0.5}
    text = json_out.dumps(value)
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert back == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, "x"], "e": 0.5}
    assert math.isnan(json.loads(json.dumps(value))["a"])  # what Python alone would have written
