"""The schema (diffrl/schema/): every field of every section carries a help text, bad input
is one ConfigError (a UserError, printed as one line), mutable defaults are not shared."""

from __future__ import annotations

import dataclasses
import typing

from diffrl.schema import Config, ConfigError, setting
from rewards.errors import UserError


def _sections(cls=Config):
    yield cls
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _sections(tp)


def test_every_field_of_every_section_has_help_text():
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in _sections()
        for f in dataclasses.fields(cls)
        if not f.metadata.get("help")
    ]
    assert missing == []


def test_a_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)


def test_mutable_defaults_are_copied_for_each_config():
    a, b = Config(), Config()
    a.eval.seeds.append(7)
    a.objective.args["x"] = 1
    assert b.eval.seeds == [0] and b.objective.args == {}

    @dataclasses.dataclass
    class Section:
        items: list = setting([1], "A list.")

    assert (
        Section().items is not Section().items
        and dataclasses.fields(Section)[0].metadata["help"] == "A list."
    )
