"""tools/transcribe_reference.py on a reference made up here, in a temporary git
repository: an ml_collections-style config pair and an argparse training script with
its shell launcher (variables, $(...) and if-blocks, as BranchGRPO's launcher has)."""

import json
import subprocess

import pytest

from tests.helpers import load_script

BASE = """import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.seed = 42
    config.resolution = 768
    config.sample = sample = ml_collections.ConfigDict()
    sample.num_steps = 40
    sample.window = (0, 10)
    config.train = train = ml_collections.ConfigDict()
    train.learning_rate = 3e-4
    config.reward_fn = ml_collections.ConfigDict()
    return config
"""
RECIPES = """import imp
import os

base = imp.load_source("base", os.path.join(os.path.dirname(__file__), "base.py"))


def small():
    config = base.get_config()
    config.dataset = os.path.join(os.getcwd(), "dataset/geneval")
    config.resolution = 512
    config.sample.num_steps = 10
    config.train.beta = 0.04
    config.reward_fn = {"geneval": 1.0}
    return config
"""
TRAIN = """import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=None)
parser.add_argument("--learning_rate", type=float, default=1e-4)
parser.add_argument("--use_hpsv2", action="store_true")
parser.add_argument("--use_group", action="store_true", default=False)
parser.add_argument("--split_points", type=str, default=None)
parser.add_argument("--ratio", type=float, default=1.0)
parser.add_argument("--eta", type=float, default=0.3, dest="eta")
"""
LAUNCH = """#!/bin/bash
conda activate somewhere
git clone https://example.invalid/never-run.git
POINTS="0,3,6,9"
GROUP="false"
if [[ "$GROUP" == "true" ]]; then
  GROUP_FLAG="--use_group"
else
  GROUP_FLAG=""
fi
torchrun --nproc_per_node=8 --master_port 19003 \\
    fastvideo/train.py \\
    --seed 42 \\
    --learning_rate 1e-5 \\
    --use_hpsv2 \\
    --split_points "${POINTS}" \\
    $( [[ "$GROUP" == "false" ]] && echo --eta 0.5 ) \\
    --ratio ${UNSET_RATIO} \\
    ${GROUP_FLAG}
"""


@pytest.fixture
def reference(tmp_path):
    repo = tmp_path / "reference"
    files = {"config/base.py": BASE, "config/grpo.py": RECIPES, "fastvideo/train.py": TRAIN, "run.sh": LAUNCH}
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "reference"], check=True)
    commit = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return str(repo / ".git"), commit


def test_an_ml_collections_recipe_resolves_to_its_flattened_values(reference):
    t = load_script("transcribe_reference")
    git, commit = reference
    values = t.transcribe_mlcollections(git, commit, "config/grpo.py", ["config/base.py"], "small")
    assert values == {
        "seed": 42,
        "resolution": 512,
        "dataset": "dataset/geneval",  # the temporary directory is cut from os.getcwd() joins
        "sample.num_steps": 10,
        "sample.window": [0, 10],
        "train.learning_rate": 3e-4,
        "train.beta": 0.04,
        "reward_fn": {"geneval": 1.0},
    }
    stub = t.transcribe_mlcollections(git, commit, "config/grpo.py", [], "small", base_stub=True)
    assert stub == {
        "dataset": "dataset/geneval",
        "resolution": 512,
        "sample.num_steps": 10,
        "train.beta": 0.04,
        "reward_fn": {"geneval": 1.0},
    }


def test_a_launch_script_sets_flags_over_the_training_script_s_defaults(reference, capsys):
    """Every argument is listed; the launcher's variables, if-blocks and $(...) expand as
    bash expands them; nothing else of the launcher runs; a flag given no value is said
    and keeps its default."""
    t = load_script("transcribe_reference")
    git, commit = reference
    values = t.transcribe_argparse(git, commit, "fastvideo/train.py", "run.sh")
    assert values == {
        "seed": 42,
        "learning_rate": 1e-5,
        "use_hpsv2": True,
        "use_group": False,
        "split_points": "0,3,6,9",
        "ratio": 1.0,
        "eta": 0.5,
    }
    assert "--ratio is given no value" in capsys.readouterr().err


def test_check_finds_a_changed_fixture_value_and_missing_evidence(reference, tmp_path, capsys):
    t = load_script("transcribe_reference")
    git, commit = reference
    fixture = tmp_path / "fixture.json"
    fixture.write_text(
        json.dumps(
            {
                "commit": commit,
                "transcription": {
                    "mode": "mlcollections",
                    "file": "config/grpo.py",
                    "also": ["config/base.py"],
                    "function": "small",
                },
                "values": {},
                "constants": {
                    "lr": {"value": 1e-4, "file": "fastvideo/train.py", "evidence": "default=1e-4"}
                },
            }
        )
    )
    assert t.main(["write", "--git", git, "--fixture", str(fixture)]) == 0
    assert t.main(["check", "--git", git, "--fixture", str(fixture)]) == 0
    data = json.loads(fixture.read_text())
    data["values"]["train.beta"] = 0.01
    data["constants"]["lr"]["evidence"] = "default=2e-4"
    fixture.write_text(json.dumps(data))
    capsys.readouterr()
    assert t.main(["check", "--git", git, "--fixture", str(fixture)]) == 1
    out = capsys.readouterr().out
    assert "train.beta: fixture 0.01, reference 0.04" in out and "'default=2e-4' not found" in out
