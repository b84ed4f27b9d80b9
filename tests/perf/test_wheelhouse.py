"""The GPU wheelhouse (tools/make_wheelhouse.py, issue 50 item 2): the pinned list
resolves offline against the wheels' own metadata (constraints/gpu-wheels.lock.json,
written by the script from the downloaded wheels) and the device's packages, and the
check names every kind of problem it exists to catch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.helpers import load_script, make_wheel


@pytest.fixture(scope="module")
def wh():
    return load_script("make_wheelhouse")


@pytest.fixture(scope="module")
def lock(wh):
    return json.loads(wh.LOCK.read_text())["wheels"]


def test_the_pinned_list_resolves_offline_against_the_locked_metadata_and_the_device(wh, lock):
    pinned, device = wh.read_pinned(), wh.read_device()
    assert wh.check_pins(lock, pinned.wanted("all")) == []
    assert wh.unmet_needs(lock, device, pinned) == []
    assert set(pinned.sets) == {"first-call", "modelopt"}
    assert set(pinned.wanted("first-call")) < set(pinned.wanted("all"))
    # held well under the 64 MiB carry limit, so a tracked tree of up to 44 MiB still carries
    assert sum(w["bytes"] for w in lock) <= 20 * 2**20


def test_the_first_call_set_holds_every_package_the_first_call_imports_that_the_device_lacks(wh):
    """diffusers for the models, torchao for FP8, open_clip (and ftfy, its tokenizer's
    need) for HPSv2; transformers, accelerate, peft, timm and scipy are the device's."""
    wanted, device = wh.read_pinned().wanted("first-call"), wh.read_device()
    for dist in ("diffusers", "torchao", "open-clip-torch", "ftfy"):
        assert dist in wanted and dist not in device, dist
    for dist in ("torch", "transformers", "accelerate", "peft", "timm", "scipy", "safetensors"):
        assert dist in device, dist
    project = (wh.ROOT / "pyproject.toml").read_text()
    needs = project[project.index("dependencies = [") : project.index("]", project.index("dependencies = ["))]
    names = [line.strip().strip('",').split(">")[0].strip() for line in needs.splitlines()[1:]]
    names = [canonicalize_name(n) for n in names if n and not n.startswith("#")]
    assert len(names) >= 15 and "scipy" in names and "open-clip-torch" in names
    for dist in names:  # every core dependency of diffrl is carried or there
        assert dist in wanted or dist in device, f"{dist}: neither carried nor on the device"


def _without(lock, name):
    return [w for w in lock if canonicalize_name(w["name"]) != name]


def test_a_missing_need_is_named(wh, lock):
    problems = wh.unmet_needs(_without(lock, "pydantic-core"), wh.read_device(), wh.read_pinned())
    assert problems == ["pydantic 2.14.4 needs pydantic-core==2.50.5: not in the wheelhouse or on the device"]
    problems = wh.unmet_needs(_without(lock, "cpsat-logutils"), wh.read_device(), wh.read_pinned())
    assert problems == ["orloge 1.0.0 needs cpsat-logutils>=1.0.0: not in the wheelhouse or on the device"]


def test_a_version_the_device_has_that_a_wheel_refuses_is_named(wh, lock):
    device = {**wh.read_device(), "huggingface-hub": "1.20.0"}
    problems = wh.unmet_needs(lock, device, wh.read_pinned())
    assert any(
        p.startswith("diffusers 0.42.1 needs huggingface-hub") and "the device has 1.20.0" in p
        for p in problems
    )


def test_the_skipped_and_allowed_needs_are_exactly_the_ones_listed(wh, lock):
    """Each entry earns its place: without it, the check flags that need."""
    pinned = wh.read_pinned()
    assert set(pinned.skip) == {"importlib-metadata"}
    assert set(pinned.allow) == {("nvidia-modelopt", "pulp<4.0")}
    assert all(len(reason) > 40 for reason in [*pinned.skip.values(), *pinned.allow.values()])
    bare = wh.Pinned(sets=pinned.sets)
    problems = wh.unmet_needs(lock, wh.read_device(), bare)
    assert sorted(problems) == [
        "diffusers 0.42.1 needs importlib_metadata: not in the wheelhouse or on the device",
        "nvidia-modelopt 0.47.0 needs pulp<4.0: the wheelhouse has 4.2.0",
    ]


def test_markers_and_extras_are_read_for_the_device(wh):
    wheel = {
        "name": "probe",
        "version": "1.0",
        "requires": [
            'old-backport; python_version < "3.12"',  # the device runs 3.12: not needed
            'windows-only; sys_platform == "win32"',
            'docs-tool; extra == "docs"',
            'linux-need; sys_platform == "linux"',
            "torch>=2.12",  # the device has 2.11.0
        ],
    }
    problems = wh.unmet_needs([wheel], wh.read_device(), wh.Pinned())
    assert problems == [
        'probe 1.0 needs linux-need; sys_platform == "linux": not in the wheelhouse or on the device',
        "probe 1.0 needs torch>=2.12: the device has 2.11.0",
    ]


def test_the_folder_check_wants_one_wheel_per_pin_and_nothing_else(wh, tmp_path):
    make_wheel(tmp_path, "alpha", "1.0", requires=["beta>=2"])
    make_wheel(tmp_path, "beta", "2.1")
    make_wheel(tmp_path, "beta", "2.2")  # two versions stop the whole install on the device
    make_wheel(tmp_path, "gamma", "0.1")  # not pinned
    wheels = [wh.wheel_info(p) for p in sorted(tmp_path.glob("*.whl"))]
    assert wheels[0]["requires"] == ["beta>=2"] and len(wheels[0]["sha256"]) == 64
    problems = wh.check_pins(wheels, {"alpha": "1.0", "beta": "2.1", "delta": "3.0"})
    assert problems == [
        "beta==2.1: the wheelhouse has 2.1, 2.2",
        "delta==3.0: the wheelhouse has no wheel",
        "gamma 0.1: not pinned (remove it)",
    ]


def test_the_carry_limit_counts_the_tracked_tree_too(wh):
    wheels = [{"bytes": 20 * 2**20}]
    assert wh.size_problems(wheels, 40 * 2**20)[0] == []
    problems, line = wh.size_problems(wheels, 45 * 2**20)
    assert len(problems) == 1 and problems[0].startswith(f"too large to carry: {line}")
    assert "wheels 20.0 MiB + tracked tree 45.0 MiB" in line
    assert "tools/device_slim.sh hide" in problems[0]  # the fix, named


def test_device_slim_hides_the_toy_bases_from_the_index_and_restores_them(tmp_path):
    """The script untracks the four toy bases in the index only (files stay on disk, git
    ignores them, so a device call does not carry them) and puts both back."""
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[2]
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(root / "tools" / "device_slim.sh", repo / "tools")
    bases = ["toy_model", "toy_model_late", "toy_model_capable", "toy_model_fewstep", "toy_video_model"]
    bases += ["toy_video_model_capable"]
    for base in bases:
        (repo / "assets" / base).mkdir(parents=True)
        (repo / "assets" / base / "w.bin").write_bytes(b"x")

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    before = git("ls-files")
    subprocess.run(["bash", "tools/device_slim.sh", "hide"], cwd=repo, check=True, capture_output=True)
    hidden = set(before.split()) - set(git("ls-files").split())
    assert hidden == {f"assets/{b}/w.bin" for b in bases[1:]}  # the first base travels
    status = git("status", "--porcelain", "--untracked-files=all").splitlines()
    # staged as deleted, and not untracked-but-visible (which a device call would carry)
    assert sorted(status) == sorted(f"D  assets/{b}/w.bin" for b in bases[1:])
    assert all((repo / "assets" / b / "w.bin").exists() for b in bases)
    subprocess.run(["bash", "tools/device_slim.sh", "restore"], cwd=repo, check=True, capture_output=True)
    assert git("ls-files") == before and git("status", "--porcelain") == ""
    assert "/assets/" not in (repo / ".git" / "info" / "exclude").read_text()


def test_a_pin_outside_a_set_is_refused(wh, tmp_path):
    bad = tmp_path / "pins.txt"
    bad.write_text("diffusers==0.42.1\n")
    with pytest.raises(ValueError, match="must be NAME==VERSION under a '# set: NAME' line"):
        wh.read_pinned(bad)
