"""Transcribe a reference repository's recipe into the values the recipe fixtures hold.

The fixtures under ``configs/recipes/references/`` are facts about other repositories:
the values a reference's config resolves to at a pinned commit. This script reads them
from a local clone at that commit (``git show COMMIT:PATH``, so the commit is what is
read, not a working tree), in one of two ways:

* ``mlcollections``: flow_grpo-style Python configs (``config/base.py`` +
  ``config/grpo.py:geneval_sd3``). The config function runs against a minimal
  stand-in for ``ml_collections.ConfigDict`` (the one class those files use), in a
  temporary directory that holds only the files named, and the resolved config is
  flattened to dotted keys. ``--base-stub`` runs a config whose base file is not
  available and records only what the named file sets.
* ``argparse``: DanceGRPO-style launches (a shell script calling a training script):
  every ``parser.add_argument`` of the training script is read from its syntax tree
  (name, default, type, ``store_true``), and the flags the launch script passes
  replace the defaults. Every argument the training script accepts is listed.

``--check FIXTURE`` transcribes again and compares with the fixture's ``values``; it
also confirms each of the fixture's ``constants`` (values hard-coded in training
scripts, transcribed by hand) by finding its ``evidence`` text in its file at the
commit. Nothing here is imported by diffrl; it needs the reference's git directory.

Examples::

    python tools/transcribe_reference.py mlcollections --git /path/flow_grpo/.git \\
        --commit ac4c86e8 --file config/grpo.py --also config/base.py --function geneval_sd3
    python tools/transcribe_reference.py argparse --git /path/DanceGRPO/.git --commit 15cc71d5 \\
        --script fastvideo/train_grpo_flux.py --launch scripts/finetune/finetune_flux_grpo.sh
    python tools/transcribe_reference.py check --git /path/flow_grpo/.git \\
        --fixture configs/recipes/references/flow_grpo_geneval_sd3.json
    python tools/transcribe_reference.py write --git /path/flow_grpo/.git \\
        --fixture configs/recipes/references/flow_grpo_geneval_sd3.json
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path


def git_show(git_dir: str, commit: str, path: str) -> str:
    """The text of ``path`` at ``commit``."""
    out = subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(f"git show {commit}:{path} failed: {out.stderr.strip()}")
    return out.stdout


def full_commit(git_dir: str, commit: str) -> str:
    out = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", commit], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"unknown commit {commit} in {git_dir}")
    return out.stdout.strip()


# -- ml_collections configs ---------------------------------------------------------------
class ConfigDict(dict):
    """What flow_grpo's configs use of ml_collections.ConfigDict: attribute access."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as err:
            raise AttributeError(name) from err

    def __setattr__(self, name, value):
        self[name] = value


def _stand_ins(base_stub: bool) -> dict[str, types.ModuleType]:
    ml = types.ModuleType("ml_collections")
    ml.ConfigDict = ConfigDict
    imp = types.ModuleType("imp")

    def load_source(name, path):
        if base_stub:  # the base file is not available: an empty config records the recipe's own keys
            module = types.ModuleType(name)
            module.get_config = lambda: ConfigDict(
                pretrained=ConfigDict(), sample=ConfigDict(), train=ConfigDict(), reward_fn=ConfigDict()
            )
            return module
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    imp.load_source = load_source
    return {"ml_collections": ml, "imp": imp}


def flatten(value, prefix: str = "", root: str = "") -> dict:
    """Dotted keys for nested ConfigDicts; plain dicts (a reward mapping) stay values; the
    temporary directory's path is cut from strings (flow_grpo joins ``os.getcwd()``)."""
    if isinstance(value, ConfigDict) and (value or not prefix):
        out = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}.", root))
        return out
    if isinstance(value, ConfigDict):
        value = {}
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, str) and root and value.startswith(root):
        value = value[len(root) :].lstrip("/")
    return {prefix[:-1]: value}


def transcribe_mlcollections(git_dir, commit, file, also, function, base_stub=False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        for path in [file, *also]:
            target = Path(tmp) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(git_show(git_dir, commit, path))
        saved_modules = {k: sys.modules.get(k) for k in ("ml_collections", "imp")}
        sys.modules.update(_stand_ins(base_stub))
        cwd, saved_env = os.getcwd(), dict(os.environ)
        try:
            os.chdir(tmp)
            for name in list(os.environ):  # a reference reading the environment gets its defaults
                if name.startswith(("SANA_", "HF_")):
                    del os.environ[name]
            spec = importlib.util.spec_from_file_location("reference_config", Path(tmp) / file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            config = getattr(module, function)()
        finally:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            for k, v in saved_modules.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
        values = flatten(config, root=os.path.realpath(tmp))
        if base_stub:  # the stand-in base's empty sections are not the recipe's
            values = {k: v for k, v in values.items() if v != {}}
        return values


# -- argparse launches --------------------------------------------------------------------
def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def argparse_arguments(source: str) -> dict[str, dict]:
    """Every ``*.add_argument(...)`` call: dest -> {flag, default, type, store_true}."""
    args = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        long = next((f for f in flags if f.startswith("--")), flags[0] if flags else None)
        kw = {k.arg: k.value for k in node.keywords}
        dest = _literal(kw["dest"]) if "dest" in kw else long.lstrip("-").replace("-", "_")
        action = _literal(kw["action"]) if "action" in kw else None
        default = _literal(kw["default"]) if "default" in kw else (False if action == "store_true" else None)
        kind = ast.unparse(kw["type"]) if "type" in kw else None
        args[dest] = {"flag": long, "default": default, "type": kind, "store_true": action == "store_true"}
    return args


def _sanitized(shell: str, script: str) -> str:
    """The launch script reduced to what sets its command line: top-level variable
    assignments, the if/else blocks that choose flags, and the call of ``script``. Nothing
    else runs (no installs, clones or downloads)."""
    text = shell.replace("\r\n", "\n").replace("\\\n", " ")
    keep = []
    for line in text.splitlines():
        bare = line.strip()
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", bare) or re.match(r"^(if|elif|else|fi)\b", bare):
            keep.append(bare)
        elif script in bare:
            keep.append(bare.rstrip().rstrip("\\"))
    return "\n".join(keep)


def launch_argv(shell: str, script: str) -> list[str]:
    """The arguments a launch script passes to ``script``, as bash expands them (its
    variables, ``$(...)`` and if-blocks), the launcher (``torchrun`` and its options)
    replaced by a function that prints what it was given."""
    body = _sanitized(shell, script)
    if script not in body:
        raise SystemExit(f"the launch script does not call {script}")
    runner = "torchrun() { printf '%s\\0' \"$@\"; }\npython() { printf '%s\\0' \"$@\"; }\n"
    out = subprocess.run(
        ["bash", "-c", runner + body], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    argv = out.stdout.split("\0")[:-1]
    at = next(i for i, a in enumerate(argv) if a.endswith(script))
    return argv[at + 1 :]


def launch_flags(argv: list[str], arguments: dict) -> tuple[dict, list[str]]:
    """Flag -> value (True for a switch) and what argparse would reject (a flag that takes
    a value given none)."""
    switches = {a["flag"] for a in arguments.values() if a["store_true"]}
    flags, problems, i = {}, [], 0
    while i < len(argv):
        flag = argv[i]
        if flag in switches:
            flags[flag], i = True, i + 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[flag], i = argv[i + 1], i + 2
        else:
            problems.append(f"{flag} is given no value (argparse: expected one argument)")
            i += 1
    return flags, problems


def transcribe_argparse(git_dir, commit, script, launch) -> dict:
    arguments = argparse_arguments(git_show(git_dir, commit, script))
    passed, problems = launch_flags(launch_argv(git_show(git_dir, commit, launch), script), arguments)
    for p in problems:
        print(f"note: {launch}: {p}; its default is kept", file=sys.stderr)
    by_flag = {a["flag"]: dest for dest, a in arguments.items()}
    values = {dest: a["default"] for dest, a in arguments.items()}
    for flag, raw in passed.items():
        if flag not in by_flag:
            raise SystemExit(f"{launch} passes {flag}, which {script} does not define")
        a = arguments[by_flag[flag]]
        cast = {"int": int, "float": float}.get(a["type"], lambda v: v)
        values[by_flag[flag]] = True if raw is True else cast(raw)
    return values


# -- the command ---------------------------------------------------------------------------
def transcribe(a) -> dict:
    if a.mode == "mlcollections":
        return transcribe_mlcollections(a.git, a.commit, a.file, a.also, a.function, a.base_stub)
    return transcribe_argparse(a.git, a.commit, a.script, a.launch)


def _from_fixture(git_dir: str, fixture: dict, commit: str | None = None) -> dict:
    """The fixture's recipe transcribed (at ``commit``, default the fixture's)."""
    how = fixture["transcription"]
    commit = commit or fixture["commit"]
    return transcribe(
        argparse.Namespace(**{"base_stub": False, "also": [], **how, "git": git_dir, "commit": commit})
    )


def write(git_dir: str, fixture_path: str, commit: str | None) -> int:
    """Fill the fixture's ``values`` from the reference (its other fields are kept)."""
    path = Path(fixture_path)
    fixture = json.loads(path.read_text())
    fixture["values"] = _from_fixture(git_dir, fixture, commit)
    path.write_text(json.dumps(fixture, indent=1, sort_keys=False) + "\n")
    print(f"{path}: {len(fixture['values'])} values")
    return 0


def check(git_dir: str, fixture_path: str, commit: str | None = None) -> int:
    """Transcribe the fixture's recipe again; compare; confirm the hand-transcribed constants.
    ``commit`` reads another commit than the fixture's (a clone made for the check)."""
    fixture = json.loads(Path(fixture_path).read_text())
    commit = commit or fixture["commit"]
    fresh = _from_fixture(git_dir, fixture, commit)
    problems = [
        f"{k}: fixture {fixture['values'].get(k)!r}, reference {fresh.get(k)!r}"
        for k in sorted(set(fresh) | set(fixture["values"]))
        if fresh.get(k) != fixture["values"].get(k)
    ]
    for key, c in fixture.get("constants", {}).items():
        text = git_show(git_dir, commit, c["file"])
        evidence = c["evidence"] if isinstance(c["evidence"], list) else [c["evidence"]]
        problems += [f"constant {key}: {e!r} not found in {c['file']}" for e in evidence if e not in text]
    for p in problems:
        print(p)
    verdict = f"{len(problems)} difference(s)" if problems else "matches"
    print(f"{fixture_path}: {verdict} at {fixture['commit']}")
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    ml = sub.add_parser("mlcollections")
    ml.add_argument("--file", required=True)
    ml.add_argument("--also", action="append", default=[])
    ml.add_argument("--function", required=True)
    ml.add_argument("--base-stub", action="store_true")
    ap = sub.add_parser("argparse")
    ap.add_argument("--script", required=True)
    ap.add_argument("--launch", required=True)
    ck = sub.add_parser("check", help="compare a fixture with the reference")
    wr = sub.add_parser("write", help="fill a fixture's values from the reference")
    for p in (ck, wr):
        p.add_argument("--fixture", required=True)
        p.add_argument("--commit", help="read this commit instead of the fixture's")
    for p in (ml, ap, ck, wr):
        p.add_argument("--git", required=True, help="the reference's git directory")
    for p in (ml, ap):
        p.add_argument("--commit", required=True)
    a = parser.parse_args(argv)
    if a.mode in ("check", "write"):
        return (check if a.mode == "check" else write)(a.git, a.fixture, a.commit)
    a.commit = full_commit(a.git, a.commit)
    print(json.dumps({"commit": a.commit, "values": transcribe(a)}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
