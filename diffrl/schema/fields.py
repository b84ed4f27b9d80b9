"""The schema's building blocks: :class:`ConfigError`, the one error bad configuration input
raises, and :func:`setting`, a dataclass field with its help text."""

from __future__ import annotations

import dataclasses
from dataclasses import field

from rewards.errors import UserError


class ConfigError(UserError, ValueError):
    """A config file or override is invalid; the message names the file, key and fix."""


def setting(default, help: str, *, valid: str | None = None, **kw):
    """A dataclass field with a help text; mutable defaults are wrapped in a factory.

    ``valid`` is the field's range, written as the error says it: ``">= 1"``, ``"> 0"``,
    ``"in [0, 1)"``, ``"in (0, 1]"``. :func:`check_ranges` checks every field that has one
    when a config loads, before anything is built, so a value out of range is one line
    naming the key (and the ``--set`` that gave it) instead of a traceback after the model
    loaded. A None value (an optional setting left unset) is never checked."""
    metadata = {"help": help}
    if valid is not None:
        _parse_range(valid)  # a typo in the schema fails at import, not at a user's start
        metadata["valid"] = valid
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        proto = default
        return field(default_factory=lambda: _copy(proto), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def _parse_range(valid: str):
    """A predicate for ``valid`` (see :func:`setting`)."""
    text = valid.strip()
    if text.startswith(("in [", "in (")):
        lo_closed, hi_closed = text[3] == "[", text[-1] == "]"
        lo, hi = (float(v) for v in text[4:-1].split(","))
        return lambda v: (lo <= v if lo_closed else lo < v) and (v <= hi if hi_closed else v < hi)
    op, bound = text.split(" ", 1)
    bound = float(bound)
    tests = {">=": lambda v: v >= bound, ">": lambda v: v > bound, "<=": lambda v: v <= bound}
    if op not in tests:
        raise ValueError(f"unknown range '{valid}'")
    return tests[op]


def check_ranges(obj, prefix: str = "") -> None:
    """Every field of ``obj`` (a config dataclass, walked into its sections and lists of
    sections) whose value is outside its declared ``valid`` range: a :class:`ConfigError`
    starting with the key."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_ranges(value, key + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_ranges(item, f"{key}[{i}].")
        valid = f.metadata.get("valid")
        if valid is None or value is None or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)) or not _parse_range(valid)(value):
            raise ConfigError(f"{key} must be {valid} (got {value!r})")


_f = setting  # short, for the many fields below


def _copy(value):
    import copy

    return copy.deepcopy(value)
