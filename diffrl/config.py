"""Loading a run configuration: YAML (a path, or a bare name found in ``configs/``) and
``--set`` overrides into the typed schema of :mod:`diffrl.schema`, then each feature's
checks of its own settings (:func:`validate`).

Loading rejects unknown keys and wrong types with one :class:`ConfigError` that names the
file (or the ``--set`` assignment), the dotted key and the valid choices, so a typo never
silently falls back to a default. ``objective.args`` is read into the chosen objective's
own dataclass (:class:`diffrl.algorithms.objective.Objective`'s ``args``). Keys that were
renamed keep working for a while: each is read under its new name and said once, in one
line (:data:`RENAMED_OBJECTIVE_KEYS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from diffrl.schema import (  # noqa: F401 - the schema's names, as callers import them from here
    Config,
    ConfigError,
    ModelConfig,
    ObjectiveConfig,
    RewardSpec,
)
from diffrl.schema.fields import check_ranges

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


# ----------------------------------------------------------------------------- types
def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _yaml_boolean_word(value, choices: tuple):
    """YAML 1.1 reads ``no`` / ``off`` as False and ``yes`` / ``on`` as True, so
    ``mixed_precision: no`` (and ``--set train.mixed_precision=no``) arrives as a bool;
    give back the word when it is one of the choices."""
    if not isinstance(value, bool):
        return value
    words = ("yes", "on", "true") if value else ("no", "off", "false")
    return next((w for w in words if w in choices), value)


def _coerce(value, tp, where: str):
    """Check ``value`` against annotation ``tp``; return the converted value or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {tp}")
    if origin is Literal:
        value = _yaml_boolean_word(value, typing.get_args(tp))
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not {_type_name(tp)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where}: expected a mapping of {tp.__name__} fields, got {type(value).__name__}"
            )
        return _build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" as a string; accept it as the float it obviously is.
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and not (
        isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, raw: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            prefix = f"{where}." if where else ""
            raise ConfigError(f"unknown key '{prefix}{key}'.{hint} Valid keys here: {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in raw.items()}
    return cls(**kwargs)


# ----------------------------------------------------------------------------- overrides
def resolve_config_path(name_or_path: str) -> Path:
    """Accept a path, or a bare name found in ``configs/`` (with or without ``.yaml``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    shipped = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(
        f"config '{name_or_path}' not found as a path or in {CONFIG_DIR}. Shipped configs: {shipped}"
    )


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override (value parsed as YAML) to a raw config mapping."""
    if "=" not in assignment:
        raise ConfigError(f"--set '{assignment}': expected KEY=VALUE, e.g. train.max_steps=2")
    key, value = assignment.split("=", 1)
    key = key.strip()
    _check_override_key(key)
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = _step_into(node, part, key)
    last = _list_index(node, parts[-1], key) if isinstance(node, list) else parts[-1]
    try:
        node[last] = yaml.safe_load(value)
    except yaml.YAMLError as err:
        problem = " ".join(str(getattr(err, "problem", "") or err).split())
        raise ConfigError(
            f"--set {key}: the value {value!r} is not valid YAML ({problem}); a list or mapping "
            "needs quotes around the whole assignment, e.g. --set 'rewards=[{name: jpeg_compressibility}]'"
        ) from None


def _step_into(node, part: str, key: str):
    """The mapping or list ``part`` names inside ``node`` (a list item by its index)."""
    if isinstance(node, list):
        return node[_list_index(node, part, key)]
    child = node.setdefault(part, {})
    if not isinstance(child, (dict, list)):
        raise ConfigError(f"--set {key}: '{part}' is not a section")
    return child


def _list_index(items: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(
            f"--set {key}: '{part}' is not an item of this list of {len(items)}: use an index from 0 to "
            f"{len(items) - 1}, e.g. --set rewards.0.args.checkpoint=PATH"
        )
    return int(part)


def _check_override_key(key: str) -> None:
    """``--set`` keys must exist in the schema (free-form mappings such as a reward's
    ``args`` accept any key below them; a renamed key is still accepted)."""
    parts = key.split(".")
    if len(parts) == 2 and parts[0] == "objective" and parts[1] in RENAMED_OBJECTIVE_KEYS:
        return
    cls, done = Config, []
    for part in parts:
        if typing.get_origin(cls) is list and part.isdigit():  # rewards.0: an item of the list
            (cls,) = typing.get_args(cls)
            done.append(part)
            continue
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return  # below a mapping, list or Any: not checked here
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" Did you mean '{'.'.join(done + [close[0]])}'?" if close else ""
            raise ConfigError(
                f"--set {key}: unknown key '{'.'.join(done + [part])}'.{hint} "
                f"Valid keys here: {', '.join(names)} (--help-config lists them all)"
            )
        cls = typing.get_type_hints(cls)[part]
        done.append(part)


# ----------------------------------------------------------------------------- renamed keys
# objective.<old> -> objective.args.<new> (issue 59): the objectives that read it, the new
# name, and the old default (an old key of another objective at its default, as every
# config.yaml a run saved before the rename holds, is dropped without a word)
RENAMED_OBJECTIVE_KEYS = {
    "nft_beta": (("nft",), "beta", 1.0),
    "nft_sample_with": (("nft",), "sample_with", "current"),
    "nft_old_decay_flat": (("nft", "awm"), "old_decay_flat", 0),
    "nft_old_decay_rate": (("nft", "awm"), "old_decay_rate", 0.001),
    "nft_old_decay_max": (("nft", "awm"), "old_decay_max", 0.5),
    "awm_huber_power": (("awm",), "huber_power", 0.25),
    "awm_advantage_max": (("awm",), "advantage_max", 1.0),
    "awm_ema_beta": (("awm",), "ema_beta", 1.0),
    "dgpo_beta": (("dgpo",), "beta", 100.0),
    "dppo_kl_threshold": (("flow_dppo",), "kl_threshold", 1e-5),
}
_SAID: set[str] = set()


def _renamed_keys(raw: dict, source: str) -> None:
    """Move the renamed ``objective`` keys of ``raw`` into ``objective.args`` (in place) and
    say so once, on the main process, in one line."""
    objective = raw.get("objective")
    if not isinstance(objective, dict):
        return
    name = objective.get("name", ObjectiveConfig.name)
    moved, ignored = [], []
    for old in [k for k in objective if k in RENAMED_OBJECTIVE_KEYS]:
        owners, new, default = RENAMED_OBJECTIVE_KEYS[old]
        value = objective.pop(old)
        if name not in owners:
            if value != default:
                ignored.append(f"objective.{old} (objective {name} does not read it)")
            continue
        args = objective.setdefault("args", {})
        if not isinstance(args, dict) or new in args:
            raise ConfigError(
                f"{source}: objective.{old} and objective.args.{new} are one setting: keep the latter"
            )
        args[new] = value
        moved.append(f"objective.{old} is objective.args.{new}")
    if moved or ignored:
        said = "; ".join(moved + [f"{i} ignored" for i in ignored])
        _say_once(f"note: {source}: {said} (the old names go in a later release; rename them)")


def _say_once(line: str) -> None:
    """Print ``line`` once per process, and only on the main process of a launch."""
    if line in _SAID:
        return
    _SAID.add(line)
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr)


# ----------------------------------------------------------------------------- loading
def config_from_dict(raw: dict, source: str = "<dict>") -> Config:
    """The validated :class:`Config` of a raw mapping (a YAML file's, ``source`` names it)."""
    _renamed_keys(raw, source)
    try:
        cfg = _build(Config, raw, "")
        cfg.objective.args = _objective_args(cfg.objective)
        validate(cfg)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return cfg


def _objective_args(objective: ObjectiveConfig):
    """``objective.args`` read into the chosen objective's own dataclass."""
    from diffrl.algorithms import get_objective

    try:
        args_type = get_objective(objective.name).args
    except ValueError as err:  # the registry's message names the valid ones and the nearest
        raise ConfigError(f"objective.name: {err}") from None
    raw = objective.args
    if dataclasses.is_dataclass(raw):  # already read (a Config built in code)
        raw = dataclasses.asdict(raw)
    return _build(args_type, raw, "objective.args")


def load_config(name_or_path: str, overrides: list[str] | tuple = ()) -> Config:
    """Load a YAML config (path or bare name), apply ``--set`` overrides, validate."""
    path = resolve_config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    for assignment in overrides:
        apply_override(raw, assignment)
    try:
        return config_from_dict(raw, str(path))
    except ConfigError as err:
        raise ConfigError(_blame_override(str(err), str(path), overrides)) from None


def _blame_override(message: str, source: str, overrides) -> str:
    """'configs/x.yaml: train.max_steps: ...' becomes '--set train.max_steps=...: ...' when
    that key came from the command line, so the user edits the right thing."""
    body = message[len(source) + 2 :] if message.startswith(source + ": ") else message
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        if body.startswith((f"{key}:", f"{key}[", f"{key}.")):
            return f"--set {assignment}: {body[len(key) :].lstrip(': ')}"
        if body.startswith(f"{key} "):  # a sentence about the key ("optim.lr must be > 0"): kept whole
            return f"--set {assignment}: {body}"
    return message


def with_overrides(cfg: Config, overrides: list[str] | tuple) -> Config:
    """A validated copy of ``cfg`` with ``--set``-style assignments applied."""
    raw = to_dict(cfg)
    for assignment in overrides:
        apply_override(raw, assignment)
    return config_from_dict(raw, f"{cfg.run_name} with overrides")


def validate(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express: the ranges of the sections that
    no feature owns here, then each feature's own checks, beside its code."""
    from diffrl.algorithms.checks import check_objective
    from diffrl.data.checks import check_data
    from diffrl.models.checks import check_model
    from diffrl.precision.checks import check_precision
    from diffrl.sampling.checks import check_sampling

    _check_ranges(cfg)
    check_sampling(cfg)
    check_precision(cfg)
    check_objective(cfg)
    check_model(cfg)
    check_data(cfg)


def _check_ranges(cfg: Config) -> None:
    """Single values out of their range: every field's declared ``valid`` range
    (:func:`~diffrl.schema.fields.check_ranges`), then what one field's range cannot say."""
    check_ranges(cfg)
    checks = [
        (len(cfg.rewards) >= 1, "rewards: at least one reward is required"),
        (
            cfg.model.height % 16 == 0 and cfg.model.width % 16 == 0,
            "model.height and model.width must be multiples of 16",
        ),
        (len(cfg.optim.betas) == 2, "optim.betas must have two values"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe(cls=Config, prefix: str = "") -> list[str]:
    """One 'key: help' line per leaf field, for `train.py --help-config`; each objective's
    own parameters as ``objective.args.KEY [objective]``."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            lines += describe(hints[f.name], key + ".")
        else:
            lines.append(f"{key} ({_type_name(hints[f.name])}): {f.metadata.get('help', '')}")
        if key == "objective.args":
            lines += _objective_args_lines()
    return lines


def _objective_args_lines() -> list[str]:
    from diffrl.algorithms import available_objectives, get_objective

    lines = []
    for name in available_objectives():
        args_type = get_objective(name).args
        hints = typing.get_type_hints(args_type)
        for f in dataclasses.fields(args_type):
            kind = _type_name(hints[f.name])
            lines.append(f"  objective.args.{f.name} [{name}] ({kind}): {f.metadata.get('help', '')}")
    return lines
