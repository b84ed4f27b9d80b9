"""Tests never touch the checkout's outputs/ (issue 40, item 4), where a user's own runs
live: the guard in conftest.py fails a test, and the session, that changed it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import tree_changes, tree_state

TESTS = Path(__file__).resolve().parent
LONG_AGO = (1_000_000_000, 1_000_000_000)  # (atime, mtime) in s: far from any write made now


def _age(root: Path) -> None:
    """Date everything under ``root`` back, so a write made now always moves an mtime
    (two writes within one clock tick can share one)."""
    for path in [root, *root.rglob("*")]:
        os.utime(path, LONG_AGO)


def test_tree_changes_see_new_runs_appends_and_deletions_and_only_the_full_look_goes_deep(tmp_path):
    root = tmp_path / "outputs"
    assert tree_state(root) == {}  # no outputs/ at all: nothing to compare
    step = root / "run" / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    (root / "run" / "metrics.jsonl").write_text("{}\n")
    (step / "w.bin").write_bytes(b"weights")
    _age(root)
    shallow, full = tree_state(root, depth=2), tree_state(root)
    assert "run/checkpoints/step-1" not in shallow and "run/checkpoints/step-1/w.bin" in full
    assert tree_changes({}, shallow)[:2] == ["created .", "created run"]
    with (root / "run" / "metrics.jsonl").open("a") as f:  # a resumed run appends
        f.write("{}\n")
    (root / "run" / "checkpoints" / "step-2").mkdir()  # and checkpoints again
    assert tree_changes(shallow, tree_state(root, depth=2)) == [
        "modified run/checkpoints",
        "modified run/metrics.jsonl",
    ]
    _age(root)
    shallow, full = tree_state(root, depth=2), tree_state(root)
    (step / "w.bin").write_bytes(b"other weights")  # deep and in place: no folder changes
    assert tree_changes(shallow, tree_state(root, depth=2)) == []
    assert tree_changes(full, tree_state(root)) == ["modified run/checkpoints/step-1/w.bin"]
    shutil.rmtree(root / "run")  # --overwrite deleting a run
    assert tree_changes(shallow, tree_state(root, depth=2))[0] == "deleted run"


DEMO = """
from pathlib import Path

OUTPUTS = Path(__file__).resolve().parents[1] / "outputs"


def test_leaves_it_alone(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}")
    assert (OUTPUTS / "old_run" / "metrics.jsonl").read_text() == "{}"


def test_writes_a_run():
    (OUTPUTS / "new_run").mkdir()
    (OUTPUTS / "new_run" / "metrics.jsonl").write_text("{}")


def test_rewrites_a_checkpoint_in_place():
    (OUTPUTS / "old_run" / "checkpoints" / "step-1" / "w.bin").write_bytes(b"other weights")
"""


def test_the_guard_fails_the_test_and_the_session_that_changed_outputs(tmp_path):
    """End to end on a copy of this suite's conftest.py and helpers.py in a project of
    its own (its outputs/ stands for the checkout's): a test that starts a run there
    fails by name; one that rewrites a file deep in a checkpoint passes its own shallow
    look but fails the session's; one that only reads passes."""
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "scripts").mkdir()  # helpers.py finds the checkout from its scripts/
    for name in ("__init__.py", "conftest.py", "helpers.py"):
        shutil.copy(TESTS / name, project / "tests" / name)
    (project / "tests" / "test_demo.py").write_text(DEMO)
    (project / "outputs" / "old_run" / "checkpoints" / "step-1").mkdir(parents=True)
    (project / "outputs" / "old_run" / "metrics.jsonl").write_text("{}")
    (project / "outputs" / "old_run" / "checkpoints" / "step-1" / "w.bin").write_bytes(b"weights")
    _age(project / "outputs")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_demo.py"],
        cwd=project,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "3 passed, 2 errors" in out, out
    assert "tests/test_demo.py::test_writes_a_run changed" in out and "created new_run/metrics.jsonl" in out
    assert "the test session changed" in out and "modified old_run/checkpoints/step-1/w.bin" in out
    assert "test_demo.py::test_leaves_it_alone changed" not in out
    assert "test_demo.py::test_rewrites_a_checkpoint_in_place changed" not in out
