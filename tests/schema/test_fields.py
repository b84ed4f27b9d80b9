"""The schema (diffrl/schema/): every field of every section carries a help text, bad input
is one ConfigError (a UserError, printed as one line), mutable defaults are not shared."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

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


# -- declared ranges (issue 62, item 8) ------------------------------------------------------
@pytest.mark.parametrize(
    "assignment,says",
    [
        ("optim.lr=-1", r"optim.lr must be >= 0 \(got -1.0\)"),
        ("model.lora.rank=0", r"model.lora.rank must be >= 1 \(got 0\)"),
        ("rollout.group_size=1", r"rollout.group_size must be >= 2 \(got 1\)"),
        ("objective.timestep_fraction=0", r"objective.timestep_fraction must be in \(0, 1\] \(got 0.0\)"),
        ("train.ema_decay=1", r"train.ema_decay must be in \[0, 1\) \(got 1.0\)"),
        ("train.replay_gap_warn=-1e-6", "train.replay_gap_warn must be >= 0"),
    ],
)
def test_a_value_out_of_range_is_one_line_blaming_the_set_that_gave_it(assignment, says):
    """Checked when the config loads, before any model is built, and blamed on the --set."""
    from diffrl.config import load_config

    with pytest.raises(ConfigError, match=rf"^--set {re.escape(assignment)}: {says}"):
        load_config("tiny_flux_flowgrpo", [assignment])


def test_a_range_from_the_file_names_the_file(tmp_path):
    from diffrl.config import load_config

    path = tmp_path / "mine.yaml"
    path.write_text("optim: {lr: -0.1}\n")
    with pytest.raises(ConfigError, match=r"mine.yaml: optim.lr must be >= 0 \(got -0.1\)"):
        load_config(str(path))


def test_ranges_reach_lists_of_sections_and_leave_unset_values_alone():
    from dataclasses import dataclass

    from diffrl.schema.fields import check_ranges, setting

    @dataclass
    class Item:
        weight: float = setting(1.0, "w", valid=">= 0")

    @dataclass
    class Holder:
        items: list = setting([], "items")
        optional: float | None = setting(None, "unset", valid="> 0")

    check_ranges(Holder(items=[Item(), Item(2.0)]))
    with pytest.raises(ConfigError, match=r"^items\[1\]\.weight must be >= 0 \(got -1\)"):
        check_ranges(Holder(items=[Item(), Item(-1)]))
    with pytest.raises(ValueError, match="unknown range"):
        setting(0, "typo", valid="=> 0")
