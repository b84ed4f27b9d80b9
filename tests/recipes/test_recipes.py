"""The field's recipes, key by key (diffrl.recipes, docs/RECIPES.md): each recipe config
against the transcribed values of the reference it reproduces. Fails on any difference
the key map does not list, on a listed deviation that is no longer one, and on a
reference key the map leaves out; the page must be the one the maps write."""

import json
import re
from pathlib import Path

import pytest

import diffrl.recipes as recipes
from diffrl.config import load_config

NAMES = recipes.recipe_names()
ROOT = Path(__file__).resolve().parents[2]


def test_the_field_s_recipes_are_all_there():
    references = {recipes.load_keymap(n)["reference"].split("_")[0] for n in NAMES}
    assert {"flow", "dancegrpo", "diffusionnft", "branchgrpo", "sol"} <= references, references


@pytest.mark.parametrize("name", NAMES)
def test_each_recipe_matches_its_reference_except_where_the_page_says_why(name):
    recipe = recipes.compare(name)
    assert recipe.problems == []
    assert len(recipe.rows) == len(recipes.reference_values(recipe.reference))


def test_the_page_is_the_one_the_key_maps_write():
    page = (ROOT / "docs" / "RECIPES.md").read_text()
    assert page == recipes.page(), "docs/RECIPES.md is out of date: python tools/recipes_page.py"


@pytest.mark.parametrize("name", NAMES)
def test_each_reference_is_pinned_and_each_constant_shows_its_evidence(name):
    fixture = recipes.load_reference(recipes.load_keymap(name)["reference"])
    assert re.fullmatch(r"[0-9a-f]{40}", fixture["commit"]) and "/" in fixture["repo"]
    assert fixture["transcription"]["mode"] in ("mlcollections", "argparse")
    assert fixture["values"], "nothing transcribed"
    for key, constant in fixture.get("constants", {}).items():
        assert constant["file"] in fixture["files"] and constant["evidence"], key


# -- the check itself can fail ----------------------------------------------------------------
def _with_override(monkeypatch, override):
    real = recipes.load_config
    monkeypatch.setattr(recipes, "load_config", lambda name: real(name, [override]))


def test_an_unlisted_difference_fails(monkeypatch):
    _with_override(monkeypatch, "objective.clip_range=1e-3")
    problems = recipes.compare("sd35_flowgrpo_geneval").problems
    assert problems == [
        "sd35_flowgrpo_geneval: train.clip_range: reference 0.0001 != ours 0.001, and no deviation is listed"
    ]


def test_a_deviation_that_no_longer_deviates_fails(monkeypatch):
    _with_override(monkeypatch, "model.dtype=float32")
    problems = recipes.compare("sd35_flowgrpo_geneval").problems
    assert (
        "sd35_flowgrpo_geneval: train_sd3: transformer weights dtype: listed as a deviation, but the "
        "values agree" in problems
    )


def test_a_reference_key_left_out_of_the_map_fails(monkeypatch):
    real = recipes.load_keymap

    def without_seed(name):
        keymap = real(name)
        keymap["keys"].pop("seed", None)
        return keymap

    monkeypatch.setattr(recipes, "load_keymap", without_seed)
    assert (
        "sd35_flowgrpo_geneval: seed: not in the key map" in recipes.compare("sd35_flowgrpo_geneval").problems
    )


def test_values_compare_as_config_values():
    assert recipes.same(5, 5.0) and recipes.same([0.9, 0.999], (0.9, 0.999)) and recipes.same(1e-4, 0.0001)
    assert not recipes.same(True, 1) and not recipes.same(0.04, 0.01) and not recipes.same({"a": 1}, {"b": 1})


def test_the_recipe_configs_load_and_name_their_reference_in_their_header():
    for name in NAMES:
        keymap = recipes.load_keymap(name)
        header = (ROOT / "configs" / f"{name}.yaml").read_text().split("\nrun_name")[0]
        fixture = recipes.load_reference(keymap["reference"])
        assert fixture["commit"][:8] in header or fixture["repo"] in header, name
        assert keymap["launch"].split()[-1] == name and load_config(name).run_name == name
        json.dumps(fixture)  # plain data
