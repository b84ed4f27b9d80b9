"""The schema's building blocks: :class:`ConfigError`, the one error bad configuration input
raises, and :func:`setting`, a dataclass field with its help text."""

from __future__ import annotations

import dataclasses
from dataclasses import field

from rewards.errors import UserError


class ConfigError(UserError, ValueError):
    """A config file or override is invalid; the message names the file, key and fix."""


def setting(default, help: str, **kw):
    """A dataclass field with a help text; mutable defaults are wrapped in a factory."""
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        proto = default
        return field(default_factory=lambda: _copy(proto), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


_f = setting  # short, for the many fields below


def _copy(value):
    import copy

    return copy.deepcopy(value)
