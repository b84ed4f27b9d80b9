"""The first command of a GPU window: the headline figures in one call of at most 600 s.

    python3 scripts/gpu_first_call.py --out "$OUT"            # on the GPU machine (see below)
    python3 scripts/gpu_first_call.py --cpu --out /tmp/first   # the same on tiny twins (CI)

A lent GPU comes as a bare machine for about 15 minutes of device time in all, a command
at most 600 s and 2,000 characters long, nothing downloads there, and only files under
the output folder come back (at most 8). This driver, under one deadline (``--deadline``,
520 s from its start by default, leaving the call's last 80 s for slack):

1. installs the carried wheels (``wheelhouse/``, made here by ``tools/make_wheelhouse.py``)
   into ``/tmp/diffrl-site`` without touching the machine's own packages, and puts them
   first on the path of this process and every child;
2. runs ``scripts/gpu_suite.py --plan first-call``: the versions, then FP8 against BF16
   exploration compiled alike by block at FLUX.1-dev size and 1024 px and the training
   step's MFU on the same model, HPSv2.1-size reward throughput, then one shrunk
   full-size iteration per family (flux, sd3, sana, qwenimage, wan22) with its memory
   against the estimate, while time remains.

Every result is written to the output folder the moment it exists (``suite.md``,
``suite.jsonl``, ``suite.log``; ``suite.json`` at the end): killed at any point, the call
still returns all that finished. What needs no GPU (the configs' meta-device memory
estimates, the wheels' import check) runs on the CPU beforehand:
``scripts/gpu_suite.sh --cpu --steps estimate`` and ``tools/make_wheelhouse.py --check``.

The device command (docs/BENCHMARKS.md, "The first GPU call"), with ``wheelhouse`` carried:

    python3 scripts/gpu_first_call.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 520  # of a 600 s command
SITE = Path("/tmp/diffrl-site")


def log(out: Path, text: str) -> None:
    """A line in the suite's log, which comes back however the call ends."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "suite.log").open("a") as f:
        f.write(text.rstrip("\n") + "\n")
    print(text, flush=True)


def install_wheels(wheels: Path, site: Path, out: Path) -> list[str]:
    """Every ``*.whl`` in ``wheels`` into ``site`` (no index, no dependencies: the
    wheelhouse is complete by construction), first on this process's path and its
    children's. Returns the wheel names; none where there is no wheelhouse."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        log(out, f"wheels: none in {wheels}; using the machine's packages")
        return []
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        log(out, f"wheels: pip failed ({done.returncode}):\n{done.stderr[-3000:]}")
        raise SystemExit(f"error: installing the wheels in {wheels} failed (see suite.log)")
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    log(out, f"wheels: {len(found)} installed into {site} in {time.monotonic() - start:.1f} s")
    return [w.name for w in found]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the output folder (the device's $OUT)")
    p.add_argument("--cpu", action="store_true", help="tiny twins on a CPU (what CI runs)")
    p.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for all of it, from the start")
    p.add_argument("--wheels", type=Path, default=ROOT / "wheelhouse", help="the carried wheels")
    p.add_argument("--site", type=Path, default=SITE, help="where the wheels are installed")
    p.add_argument("--families", default=None, help="iteration families (default: the first-call plan's)")
    return p


def main(argv=None) -> int:
    start = time.monotonic()
    a = _parser().parse_args(argv)
    log(a.out, f"==== gpu_first_call {time.strftime('%Y-%m-%d %H:%M:%S')}, deadline {a.deadline:.0f} s")
    if not a.cpu:  # on a CPU the project's own environment has every package
        install_wheels(a.wheels, a.site, a.out)
    # imported only now: the suite imports torch, diffusers and the rest from the wheels
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_suite

    left = a.deadline - (time.monotonic() - start)
    args = ["--plan", "first-call", "--deadline", f"{left:.0f}", "--out", str(a.out)]
    args += (["--cpu"] if a.cpu else []) + (["--families", a.families] if a.families else [])
    code = gpu_suite.main(args)
    log(a.out, f"==== gpu_first_call done in {time.monotonic() - start:.0f} s, exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
