"""The wheels a lent GPU machine needs, in one command, checked before they travel.

    python tools/make_wheelhouse.py                  # download every set into wheelhouse/, check
    python tools/make_wheelhouse.py --set first-call # only what scripts/gpu_first_call.py needs
    python tools/make_wheelhouse.py --check          # check an existing wheelhouse (offline)
    python tools/make_wheelhouse.py --verify         # and import it in an emulated device environment

The GPU machine has Python 3.12 on x86_64 and the packages of ``constraints/gpu-device.txt``,
and cannot download. The pinned list is ``constraints/gpu-wheels.txt``. The check:

1. every pinned ``name==version`` has exactly one wheel, and no other wheel is there;
2. every need a wheel declares (``Requires-Dist``, markers evaluated for Python 3.12 on
   Linux x86_64) is met by another wheel or by the device's packages, at the declared
   versions where the device's version is known, except the needs the pinned list
   skips or allows by name, each with its reason;
3. the wheels and the tracked tree fit the 64 MiB a device call carries.

``--verify`` installs the wheels into a temporary folder and imports diffusers, torchao,
open_clip and modelopt from it with this machine's base Python, whose path holds only
that folder and this environment's copies of the device's packages: an import-time need
that no metadata declares fails here, not on the GPU. Binary wheels built for 3.12 are
replaced for that by the same versions built for this Python.

Writes ``wheelhouse/manifest.json`` (each wheel's name, version, size, sha256 and declared
needs); ``--lock`` also writes it to ``constraints/gpu-wheels.lock.json``, which the tests
check offline against the pinned list and the device's packages.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PINNED = ROOT / "constraints" / "gpu-wheels.txt"
DEVICE = ROOT / "constraints" / "gpu-device.txt"
LOCK = ROOT / "constraints" / "gpu-wheels.lock.json"
CARRY_LIMIT = 64 * 2**20  # what one device call carries: the working tree and carried paths
# the device's interpreter and platform (the device tool's KINDS.md: Python 3.12.3, x86_64)
DEVICE_PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
)
PLATFORMS += ("manylinux2014_x86_64", "manylinux1_x86_64")
# what --verify imports: the modules the first call and the quant step load
IMPORTS = ("diffusers", "torchao.quantization", "open_clip", "ftfy", "modelopt.torch.quantization")


@dataclass
class Pinned:
    """The pinned list: ``sets`` of ``{name: version}``, the skipped needs and the
    allowed unmet ones (``(wheel, requirement)``), each with its reason."""

    sets: dict[str, dict[str, str]] = field(default_factory=dict)
    skip: dict[str, str] = field(default_factory=dict)
    allow: dict[tuple[str, str], str] = field(default_factory=dict)

    def wanted(self, chosen: str = "all") -> dict[str, str]:
        names = self.sets if chosen == "all" else {chosen: self.sets[chosen]}
        return {n: v for pins in names.values() for n, v in pins.items()}


_SKIP = re.compile(r"^#\s*skip:\s*([\w.-]+):\s*(.+)$")
_ALLOW = re.compile(r"^#\s*allow:\s*([\w.-]+) needs ([^:]+):\s*(.+)$")


def read_pinned(path: Path = PINNED) -> Pinned:
    pinned, current, last = Pinned(), None, None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if m := re.match(r"^#\s*set:\s*([\w-]+)", line):
            current = pinned.sets.setdefault(m.group(1), {})
        elif m := _SKIP.match(line):
            pinned.skip[canonicalize_name(m.group(1))] = m.group(2)
        elif m := _ALLOW.match(line):
            last = (canonicalize_name(m.group(1)), str(Requirement(m.group(2).strip())))
            pinned.allow[last] = m.group(3)
        elif line.startswith("#") and last and raw.startswith("#   "):
            pinned.allow[last] += " " + line.lstrip("# ")  # a continued reason
        elif line and not line.startswith("#"):
            name, _, version = line.partition("==")
            if current is None or not version:
                raise ValueError(f"{path}: '{line}' must be NAME==VERSION under a '# set: NAME' line")
            current[canonicalize_name(name)] = version.strip()
            last = None
    return pinned


def read_device(path: Path = DEVICE) -> dict[str, str | None]:
    """The device's packages: name -> version, None where the version was not seen."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version.strip() or None
    return out


# -- wheels --------------------------------------------------------------------------------
def wheel_info(path: Path) -> dict:
    """A wheel's name, version, size, sha256 and declared needs (from its METADATA)."""
    name, version, _, _ = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as whl:
        member = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(whl.read(member).decode())
    return {
        "file": path.name,
        "name": str(name),
        "version": str(version),
        "bytes": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "requires": metadata.get_all("Requires-Dist") or [],
    }


def device_environment() -> dict:
    env = default_environment()
    env.update(
        python_version=DEVICE_PYTHON,
        python_full_version=f"{DEVICE_PYTHON}.3",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def unmet_needs(wheels: list[dict], device: dict[str, str | None], pinned: Pinned) -> list[str]:
    """Every declared need (no extras, markers for the device) that neither another
    wheel nor the device meets, nor the pinned list skips or allows; one line each."""
    have = {canonicalize_name(w["name"]): w["version"] for w in wheels}
    env = device_environment()
    problems = []
    for w in wheels:
        for text in w["requires"]:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue  # an extra's need, or another platform's
            name = canonicalize_name(req.name)
            if name in pinned.skip or (canonicalize_name(w["name"]), str(_plain(req))) in pinned.allow:
                continue
            version = have.get(name, device.get(name))
            if name not in have and name not in device:
                problems.append(
                    f"{w['name']} {w['version']} needs {req}: not in the wheelhouse or on the device"
                )
            elif version is not None and not req.specifier.contains(Version(version), prereleases=True):
                where = "wheelhouse" if name in have else "device"
                problems.append(f"{w['name']} {w['version']} needs {req}: the {where} has {version}")
    return problems


def _plain(req: Requirement) -> Requirement:
    """The requirement without its marker (the allow list names name and versions only)."""
    return Requirement(f"{req.name}{req.specifier}")


def check_pins(wheels: list[dict], wanted: dict[str, str]) -> list[str]:
    """Exactly one wheel per pinned name, at its version, and nothing else."""
    problems, seen = [], {}
    for w in wheels:
        seen.setdefault(canonicalize_name(w["name"]), []).append(w["version"])
    for name, version in wanted.items():
        versions = seen.get(name, [])
        if versions != [version]:
            problems.append(f"{name}=={version}: the wheelhouse has {', '.join(versions) or 'no wheel'}")
    problems += [f"{n} {', '.join(v)}: not pinned (remove it)" for n, v in seen.items() if n not in wanted]
    return problems


def tracked_bytes(root: Path = ROOT) -> int:
    """The tracked tree's size, what every device call carries besides the wheels."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return sum((root / f).stat().st_size for f in files.decode().split("\0") if f and (root / f).is_file())


def size_problems(wheels: list[dict], tree_bytes: int, limit: int = CARRY_LIMIT) -> tuple[list[str], str]:
    total = sum(w["bytes"] for w in wheels)
    mib = 2**20
    line = f"wheels {total / mib:.1f} MiB + tracked tree {tree_bytes / mib:.1f} MiB of {limit / mib:.0f} MiB"
    hint = "; 'tools/device_slim.sh hide' keeps the toy bases out of the call (restore after it)"
    return ([f"too large to carry: {line}{hint}"] if total + tree_bytes > limit else []), line


def check(
    folder: Path, chosen: str = "all", tree_bytes: int | None = None
) -> tuple[list[str], list[dict], str]:
    """(problems, wheel infos, size line) of the wheelhouse in ``folder``."""
    pinned = read_pinned()
    wheels = [wheel_info(p) for p in sorted(folder.glob("*.whl"))]
    problems = check_pins(wheels, pinned.wanted(chosen))
    problems += unmet_needs(wheels, read_device(), pinned)
    sizes, line = size_problems(wheels, tracked_bytes() if tree_bytes is None else tree_bytes)
    return problems + sizes, wheels, line


# -- downloading and verifying ----------------------------------------------------------------
def download(folder: Path, wanted: dict[str, str], python: str = DEVICE_PYTHON, quiet: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python, "--implementation", "cp", "-d", str(folder)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    output = subprocess.DEVNULL if quiet else None
    subprocess.run(command + [f"{n}=={v}" for n, v in wanted.items()], check=True, stderr=output)


def verify_imports(folder: Path, device: dict[str, str | None]) -> str:
    """Install the wheelhouse into a temporary folder and import :data:`IMPORTS` from it
    with the base interpreter, seeing only that folder and this environment's copies of
    the device's packages. A binary wheel built for the device's Python alone is replaced
    by the same version built for this one; where none exists, the modules that need it
    are not imported and the output says so. Returns what the check printed; raises if
    an import failed."""
    import importlib.metadata as metadata

    with tempfile.TemporaryDirectory() as tmp:
        site, local, shim = Path(tmp, "site"), Path(tmp, "local"), Path(tmp, "device")
        ours = f"{sys.version_info.major}.{sys.version_info.minor}"
        portable, missing = [], []
        for path in sorted(folder.glob("*.whl")):
            name, version, _, tags = parse_wheel_filename(path.name)
            if any(t.abi in ("none", "abi3") for t in tags):
                portable.append(path)
                continue
            try:  # the same version, built for this Python
                download(local, {str(name): str(version)}, ours, quiet=True)
            except subprocess.CalledProcessError:
                missing.append(str(name))
        portable += sorted(local.glob("*.whl"))
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
        # a pure-Python wheel that says it needs the device's Python may still import here
        subprocess.run(pip + ["--ignore-requires-python", *map(str, portable)], check=True)
        _device_shim(shim, device, metadata.packages_distributions())
        modules = [m for m in IMPORTS if not (missing and m.startswith("modelopt"))]
        code = (
            "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import importlib; "
            f"[print('imported', m, 'from', importlib.import_module(m).__file__) for m in {modules!r}]"
        )
        base = getattr(sys, "_base_executable", sys.executable)
        done = subprocess.run([base, "-I", "-c", code, str(site), str(shim)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"importing the wheelhouse failed:\n{done.stderr[-4000:]}")
        skipped = [m for m in IMPORTS if m not in modules]
        note = (
            f"not imported here: {', '.join(skipped)} (no build of {', '.join(missing)} for Python {ours})\n"
        )
        return done.stdout + (note if skipped else "")


def _device_shim(shim: Path, device: dict[str, str | None], owners: dict[str, list[str]]) -> None:
    """``shim`` holding links to this environment's copies of the device's packages: their
    modules and their metadata (diffusers checks its needs' versions at import)."""
    import importlib.metadata as metadata

    shim.mkdir()
    device = _local_closure(device)  # and what this environment's copies of them need
    for top, dists in owners.items():
        if any(canonicalize_name(d) in device for d in dists):
            source = _top_level_path(top)
            if source is not None and not (shim / source.name).exists():
                (shim / source.name).symlink_to(source)
    for dist in metadata.distributions():
        info = getattr(dist, "_path", None)  # the .dist-info folder of an installed distribution
        name = dist.metadata["Name"]
        if (
            name
            and canonicalize_name(name) in device
            and info is not None
            and not (shim / info.name).exists()
        ):
            (shim / info.name).symlink_to(info)


def _local_closure(names) -> set[str]:
    """``names`` and, recursively, what this environment's copies of them declare they
    need (this huggingface_hub may need a package the device's older one does not)."""
    import importlib.metadata as metadata

    env = default_environment()
    todo, seen = [canonicalize_name(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def _top_level_path(top: str) -> Path | None:
    """Where this environment has the top-level module ``top`` (a package or a file)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return None
    origin = Path(spec.origin)
    return origin.parent if origin.name == "__init__.py" else origin


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=ROOT / "wheelhouse", help="the wheelhouse (git-ignored)")
    p.add_argument("--set", default="all", help="all, or one set of the pinned list (first-call, modelopt)")
    p.add_argument("--check", action="store_true", help="check the wheelhouse as it is, download nothing")
    p.add_argument("--verify", action="store_true", help="also import it in an emulated device environment")
    p.add_argument(
        "--lock", action="store_true", help="write the manifest to constraints/gpu-wheels.lock.json"
    )
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    pinned = read_pinned()
    if a.set != "all" and a.set not in pinned.sets:
        raise SystemExit(f"error: --set {a.set}: use all or one of {', '.join(pinned.sets)}")
    if not a.check:
        download(a.dir, pinned.wanted(a.set))
    problems, wheels, sizes = check(a.dir, a.set)
    manifest = json.dumps({"python": DEVICE_PYTHON, "set": a.set, "wheels": wheels}, indent=1) + "\n"
    (a.dir / "manifest.json").write_text(manifest)
    if a.lock:
        LOCK.write_text(manifest)
    print(f"{len(wheels)} wheels in {a.dir}: {sizes}")
    for line in problems:
        print(f"problem: {line}")
    if a.verify and not problems:
        print(verify_imports(a.dir, read_device()), end="")
        print("imports: the modules above imported in an emulated device environment")
    if problems:
        return 1
    where = a.dir.relative_to(ROOT) if a.dir.is_relative_to(ROOT) else a.dir
    print(f"carry it: name '{where}' in the device call's carry (docs/BENCHMARKS.md, 'The first GPU call')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
