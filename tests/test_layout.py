"""The repository's shape (issue 17): a short top level, one import direction between the
two top-level packages, and tests that mirror the source tree."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_rewards_never_imports_diffrl():
    """diffrl uses rewards (the trainer scores with them); rewards stands alone, so a reward
    can be benchmarked or served without the training stack."""
    offenders = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.split(".")[0] == "diffrl")
        for p in (ROOT / "rewards").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_diffrl_keeps_a_short_flat_top_level():
    flat = sorted(p.name for p in (ROOT / "diffrl").glob("*.py"))
    assert len(flat) <= 8, flat


def test_every_source_package_has_a_test_directory():
    """diffrl/X is tested in tests/X, rewards/X in tests/rewards/X."""
    expected = [Path("tests") / p.name for p in (ROOT / "diffrl").iterdir() if (p / "__init__.py").is_file()]
    expected += [
        Path("tests/rewards") / p.name for p in (ROOT / "rewards").iterdir() if (p / "__init__.py").is_file()
    ]
    assert [str(t) for t in expected if not (ROOT / t).is_dir()] == []


def test_no_function_runs_over_sixty_lines():
    """A function a reader cannot see on one screen is split (issue 17): measured on the
    formatted source, decorators and docstring included."""
    long = []
    for folder in ("diffrl", "rewards", "scripts", "tools", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 60:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


# The house (docs/ARCHITECTURE.md): each room may import the rooms on earlier lines and
# never one on its own line or a later one, so no import runs back up and no circle forms.
# Imports inside functions count too.
FLOORS = [
    ["rewards"],
    ["diffrl/schema"],
    ["diffrl/sampling", "diffrl/data", "diffrl/runtime"],
    ["diffrl/models"],
    ["diffrl/algorithms", "diffrl/precision"],
    ["diffrl/config.py"],
    ["diffrl/inference", "diffrl/twin.py", "diffrl/recipes.py"],
    ["diffrl/evaluation"],
    ["diffrl/training"],
    ["diffrl/perf", "diffrl/toy", "diffrl/cli.py"],
    ["diffrl/train.py", "diffrl/serve.py"],
]


def _room(module: str) -> str | None:
    """The room of an imported module name (None: outside the two packages)."""
    parts = module.split(".")
    if parts[0] == "rewards":
        return "rewards"
    if parts[0] != "diffrl" or len(parts) < 2:
        return None
    folder = ROOT / "diffrl" / parts[1]
    return f"diffrl/{parts[1]}" if folder.is_dir() else f"diffrl/{parts[1]}.py"


def _room_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return "rewards" if rel[0] == "rewards" else "/".join(rel[:2])


def test_every_import_runs_down_the_house():
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
    files = [p for folder in ("diffrl", "rewards") for p in (ROOT / folder).rglob("*.py")]
    rooms = {_room_of_file(p) for p in files if p.name != "__init__.py" or p.parent != ROOT / "diffrl"}
    assert sorted(rooms - set(floor)) == [], "a new room: give it a floor in FLOORS and ARCHITECTURE.md"
    upward = []
    for path in files:
        here = _room_of_file(path)
        if here not in floor:
            continue
        for name in _imports(path):
            there = _room(name)
            if there is not None and there != here and floor[there] >= floor[here]:
                upward.append(f"{path.relative_to(ROOT)} imports {name} ({there}, floor {floor[there]})")
    assert upward == []


def test_only_training_builds_a_trainer():
    """Evaluations, protocols, comparisons and probes sample through an inference session
    (diffrl/inference); the benchmarks that time whole training iterations, and the table of
    the trainer's own replay gap, are training."""
    allowed = {
        "diffrl/training",
        "diffrl/cli.py",
        "diffrl/perf/bench.py",
        "diffrl/perf/suite.py",
        "tools/replay_gap_table.py",
    }
    builders = []
    for folder in ("diffrl", "scripts", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if "Trainer(" in path.read_text() and not any(rel.startswith(a) for a in allowed):
                builders.append(rel)
    assert builders == []


def test_no_library_file_runs_over_five_hundred_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "diffrl").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert long == {}
