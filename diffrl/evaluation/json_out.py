"""JSON that strict parsers read: Python's ``json`` writes NaN and Infinity, which are not
JSON (RFC 8259) and which ``jq``, JavaScript's ``JSON.parse`` and most other languages'
parsers refuse. An evaluation's score can be NaN (a reward that did not apply); it is
written as null, as ``metrics.jsonl`` writes it (issue 62, item 11)."""

from __future__ import annotations

import json
import math


def finite_or_null(value):
    """``value`` with every non-finite float, at any depth of dicts, lists and tuples, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """``json.dumps`` of ``value`` with non-finite floats as null; never writes NaN."""
    return json.dumps(finite_or_null(value), allow_nan=False, **kwargs)
