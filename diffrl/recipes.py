"""The field's recipes, key by key: each shipped recipe config against the reference
config it reproduces (docs/RECIPES.md is written from here).

Two files per recipe, under ``configs/recipes/``:

* ``references/<id>.json``: the reference's values, facts transcribed from its config
  files at a pinned commit (``tools/transcribe_reference.py`` writes ``values`` and
  re-checks them against a clone; ``constants`` are values hard-coded in its training
  script, each with the text that shows it);
* ``<config>.yaml``: the key map. Every reference key has one entry: ``ours`` (an
  expression over ``cfg``, the loaded diffrl config, optionally against ``ref``, an
  expression over ``r``, the reference's values, and ``gpus``, its GPU count), with a
  ``deviation`` saying why exactly when the two differ; or ``none`` saying why the key
  has no counterpart here (log directories, wandb switches, ...). Its ``behaviour`` list
  holds what the reference's training script does where no key shows (which samples
  train, which branch carries the gradient): each entry names the behaviour, where the
  script does it (``where``: file and line), the reference's way (``reference``) and
  ``ours``, an expression over ``cfg`` that must give the same words unless a
  ``deviation`` says why not.

:func:`compare` holds a recipe to its reference; tests/recipes fails on any difference
the map does not list, on a listed deviation that is no longer one, and on any
reference key the map leaves out.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import yaml

from diffrl.config import CONFIG_DIR, load_config

RECIPE_DIR = CONFIG_DIR / "recipes"


def lora_targets(cfg) -> list[str]:
    """The modules the run adapts: ``model.lora.target_modules`` or the family's default."""
    from diffrl.models import adapter_class

    return list(cfg.model.lora.target_modules or adapter_class(cfg.model.family).default_lora_targets)


def lora_init() -> str:
    from diffrl.models.policy import LORA_INIT

    return LORA_INIT


def reward_arg(spec, key: str):
    """A reward entry's argument ``key``: as the config gives it, else the reward's default
    (its ``default_<key>`` attribute, else its signature's default)."""
    import inspect

    import rewards

    if key in spec.args:
        return spec.args[key]
    factory = rewards.REWARDS.get(spec.name)
    if getattr(factory, f"default_{key}", None) is not None:
        return getattr(factory, f"default_{key}")
    param = inspect.signature(factory).parameters.get(key)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


_NAMES = {
    "len": len,
    "int": int,
    "float": float,
    "round": round,
    "sorted": sorted,
    "set": set,
    "min": min,
    "max": max,
    "lora_targets": lora_targets,
    "lora_init": lora_init,
    "reward_arg": reward_arg,
    "str": str,
    "abs": abs,
}


@dataclass
class Row:
    """One reference key: its value, ours, and what the map says of them."""

    key: str
    reference: object
    ours_expr: str | None  # None: no counterpart
    ours: object = None
    note: str = ""  # the deviation, or why there is no counterpart
    kind: str = "same"  # same | deviation | none
    problem: str = ""  # what makes the map wrong (empty when it holds)
    label: str = ""  # what a derived comparison compares ("prompts per iteration")
    ref_expr: str = ""  # how the compared reference value follows from its keys
    raw: object = None  # the reference's own value, when ``reference`` is derived from it


@dataclass
class Recipe:
    config: str
    reference: dict  # the fixture
    keymap: dict
    rows: list[Row]
    behaviour: list[Row]  # what the training script does where no key shows

    @property
    def problems(self) -> list[str]:
        rows = self.rows + self.behaviour
        return [f"{self.config}: {r.key}: {r.problem}" for r in rows if r.problem]


def recipe_names() -> list[str]:
    """The configs that have a key map (files starting with _ are shared parts)."""
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def load_keymap(name: str) -> dict:
    """A key map, with the entries of the maps it ``include``s (its own win)."""
    keymap = yaml.safe_load((RECIPE_DIR / f"{name}.yaml").read_text())
    keys, behaviour = {}, []
    for part in keymap.get("include", []):
        shared = load_keymap(part)
        keys.update(shared["keys"])
        behaviour += shared["behaviour"]
    own = keymap.get("keys") or {}
    keys.update(own)
    keymap["keys"], keymap["own_keys"] = keys, set(own)
    keymap["behaviour"] = behaviour + list(keymap.get("behaviour") or [])
    return keymap


def load_reference(ref_id: str) -> dict:
    return json.loads((RECIPE_DIR / "references" / f"{ref_id}.json").read_text())


def reference_values(fixture: dict) -> dict:
    """Transcribed values and hand-transcribed constants, by key."""
    values = dict(fixture["values"])
    values.update({k: c["value"] for k, c in fixture.get("constants", {}).items()})
    return values


def same(a, b) -> bool:
    """Equal as config values: numbers to 1e-9 relative, lists and tuples alike."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a == b and type(a) is type(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def _evaluate(expr: str, cfg, values: dict, scale: dict):
    """A map expression: ``cfg`` (ours), ``r`` (the reference's values), ``gpus`` (the
    reference's GPU count), ``procs`` (the processes our config is launched on)."""
    # one namespace as the globals, so that comprehensions see it too
    return eval(expr, {"__builtins__": {}, **_NAMES, "cfg": cfg, "r": values, **scale})  # noqa: S307


def _row(key: str, entry: dict | None, cfg, values: dict, scale: dict) -> Row:
    reference = values[key]
    if entry is None:
        return Row(key, reference, None, problem="not in the key map")
    if "none" in entry:
        return Row(key, reference, None, note=entry["none"], kind="none")
    try:
        ours = _evaluate(entry["ours"], cfg, values, scale)
        if "ref" in entry:
            reference = _evaluate(entry["ref"], cfg, values, scale)
    except Exception as err:  # a map expression that fails is a map error, reported as one
        return Row(key, reference, entry.get("ours"), problem=f"expression failed: {err!r}")
    row = Row(key, reference, entry["ours"], ours, entry.get("deviation", ""), label=entry.get("label", ""))
    row.ref_expr, row.raw = entry.get("ref", ""), values[key]
    if same(reference, ours):
        row.problem = "listed as a deviation, but the values agree" if row.note else ""
    else:
        row.kind = "deviation"
        row.problem = (
            "" if row.note else f"reference {reference!r} != ours {ours!r}, and no deviation is listed"
        )
    return row


def _behaviour_row(entry: dict, cfg, values: dict, scale: dict) -> Row:
    """One behaviour of the reference's script: its way (words) against ours (an
    expression over ``cfg`` giving words)."""
    key = f"{entry['what']} ({entry['where']})"
    row = Row(key, entry["reference"], entry["ours"], note=entry.get("deviation", ""))
    try:
        row.ours = _evaluate(entry["ours"], cfg, values, scale)
    except Exception as err:  # a map expression that fails is a map error, reported as one
        row.problem = f"expression failed: {err!r}"
        return row
    if row.ours == row.reference:
        row.problem = "listed as a deviation, but the behaviours agree" if row.note else ""
    else:
        row.kind = "deviation"
        row.problem = (
            "" if row.note else f"the reference {row.reference!r}, ours {row.ours!r}, no deviation listed"
        )
    return row


def compare(config: str) -> Recipe:
    """The recipe ``config`` held against its reference, row by row."""
    keymap = load_keymap(config)
    fixture = load_reference(keymap["reference"])
    values = reference_values(fixture)
    cfg = load_config(config)
    entries = keymap["keys"]
    scale = {"gpus": keymap.get("gpus", 1), "procs": keymap.get("procs", 1)}
    rows = [_row(k, entries.get(k), cfg, values, scale) for k in sorted(values)]
    # a shared part may map keys one of its references lacks; the recipe's own map may not
    extra = sorted(keymap["own_keys"] - set(values))
    rows += [Row(k, None, None, problem="mapped, but not a reference key") for k in extra]
    behaviour = [_behaviour_row(entry, cfg, values, scale) for entry in keymap["behaviour"]]
    return Recipe(config, fixture, keymap, rows, behaviour)


# -- the page --------------------------------------------------------------------------------
def _cell(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text.replace("|", "\\|").replace("\n", " ")


def render(recipes: list[Recipe]) -> str:
    """docs/RECIPES.md."""
    out = [
        "# Recipes, key by key",
        "",
        "<!-- written by `python tools/recipes_page.py`; edit configs/recipes/, not this page -->",
        "",
        "Each recipe below is a shipped config held against the reference config it reproduces,",
        "every key of it: the reference's value (transcribed from its files at the pinned commit,",
        "`configs/recipes/references/`), ours, and where they differ, why. `pytest tests/recipes`",
        "fails on any difference not listed here; `tools/transcribe_reference.py check` re-reads",
        "a reference from a clone and compares it with the transcription.",
        "",
        "| recipe | reference | keys | same | deviations | no counterpart |",
        "|---|---|---|---|---|---|",
    ]
    for rc in recipes:
        counts = {k: sum(r.kind == k for r in rc.rows) for k in ("same", "deviation", "none")}
        out.append(
            f"| [`{rc.config}`](#{rc.config}) | {rc.reference['repo']} `{rc.reference['recipe']}` | "
            f"{len(rc.rows)} | {counts['same']} | {counts['deviation']} | {counts['none']} |"
        )
    for rc in recipes:
        out += _section(rc)
    return "\n".join(out) + "\n"


def _section(rc: Recipe) -> list[str]:
    ref = rc.reference
    files = ", ".join(f"`{f}`" for f in ref["files"])
    lines = [
        "",
        f"## {rc.config}",
        "",
        f"{rc.keymap.get('summary', '').strip()}",
        "",
        f"* reference: [{ref['repo']}](https://github.com/{ref['repo']}) at `{ref['commit']}`, "
        f"`{ref['recipe']}` ({files})",
        f"* ours: `configs/{rc.config}.yaml`, launched as `{rc.keymap['launch']}`",
    ]
    if ref.get("note"):
        lines.append(f"* transcription: {ref['note']}")
    lines += ["", "| reference key | reference | diffrl | ours | |", "|---|---|---|---|---|"]
    for r in rc.rows:
        if r.kind == "none":
            lines.append(f"| `{r.key}` | {_cell(r.reference)} | — | — | no counterpart: {_cell(r.note)} |")
            continue
        mark = "" if r.kind == "same" else f"**deviates**: {_cell(r.note)}"
        shown = f"`{_cell(r.ours_expr.replace('cfg.', ''))}`"
        reference = _cell(r.reference)
        if r.label:
            shown = f"{r.label}: {shown}"
        if r.ref_expr:
            derived = re.sub(r"r\['([^']+)'\]", r"\1", r.ref_expr).replace("cfg.", "")
            reference = f"{_cell(r.raw)}, compared as {reference} (`{_cell(derived)}`)"
        lines.append(f"| `{r.key}` | {reference} | {shown} | {_cell(r.ours)} | {mark} |")
    return lines + _behaviour_table(rc)


def _behaviour_table(rc: Recipe) -> list[str]:
    """What the reference's training script does where no key shows, and ours."""
    if not rc.behaviour:
        return []
    lines = [
        "",
        "Behaviour where no key shows (the reference's training script, read line by line):",
        "",
        "| behaviour (where) | reference | diffrl | ours | |",
        "|---|---|---|---|---|",
    ]
    for r in rc.behaviour:
        mark = "" if r.kind == "same" else f"**deviates**: {_cell(r.note)}"
        shown = f"`{_cell(r.ours_expr.replace('cfg.', ''))}`"
        lines.append(f"| {_cell(r.key)} | {_cell(r.reference)} | {shown} | {_cell(r.ours)} | {mark} |")
    return lines


def page() -> str:
    return render([compare(name) for name in recipe_names()])
