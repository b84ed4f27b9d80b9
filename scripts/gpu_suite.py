"""Every headline GPU figure in one command, and the same suite on tiny twins on a CPU.

    scripts/gpu_suite.sh --out outputs/gpu_suite          # one H100/H200, no downloads
    scripts/gpu_suite.sh --cpu --out /tmp/suite           # tiny twins on a CPU (CI runs this)

Steps (``--steps``, default all), each measured in its own process where memory matters:

* ``quant``: torchao and modelopt import and ``auto`` picks them (reference on a CPU);
  each real backend's copy against the reference quantizer's (diffrl.perf.suite).
* ``iteration``: one shrunk full-size iteration per family (tiny twin on a CPU), seconds
  and peak memory against ``estimate_built`` of the same run.
* ``fsdp``: FSDP start-up on one process, a full fine-tune: the peak while the trainer
  is built against the estimate of what exists then.
* ``precision``: FP8 and NVFP4 exploration against a merged BF16 copy, compiled alike,
  FLUX size at 1024 px (``bench_rollout.py --sections precision``).
* ``train``: training-step time and MFU under the config's autocast, FLUX size.
* ``rewards``: HPSv2.1-size reward throughput on real-size images.
* ``estimate``: every config whose header says ``# fits: N x M GB, ddp|fsdp`` fits it.

Writes ``suite.md`` (one table) and ``suite.json`` to ``--out`` and exits 1 when a check
fails or a step crashes (a performance target missed is reported, not an error).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from diffrl.perf import suite  # noqa: E402
from diffrl.training.setup import FSDP_LAUNCH_ENV  # noqa: E402

STEPS = ("quant", "iteration", "fsdp", "precision", "train", "rewards", "estimate")
CHECKS = ("quant", "iteration", "fsdp", "estimate")  # a False there fails the suite
FITS = re.compile(r"^# fits: (\d+) ?x (\d+) GB, (ddp|fsdp)", re.MULTILINE)


def _python(args: list[str], env: dict | None = None, timeout: int = 900) -> None:
    run = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} ... exited {run.returncode}:\n{run.stderr[-2500:]}")


def _worker_json(args: list[str], tmp: Path, env: dict | None = None, launcher: list[str] = ()) -> dict:
    out = tmp / f"w{len(list(tmp.iterdir()))}.json"
    _python([*launcher, str(Path(__file__)), *args, "--json", str(out)], env)
    return json.loads(out.read_text())


# -- steps --------------------------------------------------------------------------------
def step_iteration(a, tmp: Path) -> list[dict]:
    rows = []
    for family in a.families.split(","):
        flags = ["--worker", "iteration", "--family", family] + (["--cpu"] if a.cpu else [])
        try:
            rows += suite.iteration_rows(family, _worker_json(flags, tmp), a.cpu)
        except Exception as err:  # one family's failure must not hide the others
            rows.append(
                suite.row("iteration", f"{family}: failed", str(err).splitlines()[-1][:200], "runs", False)
            )
    return rows


def step_fsdp(a, tmp: Path) -> list[dict]:
    env = {**FSDP_LAUNCH_ENV, **({"ACCELERATE_USE_CPU": "true"} if a.cpu else {})}
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "1"]
    flags = ["--worker", "fsdp"] + (["--cpu"] if a.cpu else [])
    return suite.fsdp_startup_rows(_worker_json(flags, tmp, env, launcher), 1)


def _bench_rollout(a, tmp: Path, sections: str, extra: list[str]) -> dict:
    out = tmp / f"{sections}.json"
    model = ["--config", "tiny_flux_solrl"] if a.cpu else ["--config", "flux_solrl", "--full-size"]
    _python(["scripts/bench_rollout.py", *model, "--sections", sections, *extra, "--json", str(out)])
    return json.loads(out.read_text())["results"]


def step_precision(a, tmp: Path) -> list[dict]:
    if a.cpu:  # the reference quantizer; torch.compile is left to the GPU run (minutes on 2 cores)
        extra = ["--modes", "bf16,fp8:reference,nvfp4:reference", "--repeats", "2"]
    else:
        extra = ["--modes", "bf16,fp8:auto,nvfp4:auto", "--resolution", "1024", "--batch", "4", "--compile"]
    rows = []
    for r in _bench_rollout(a, tmp, "precision", extra)["precision"]:
        if r["mode"] == "bf16":
            continue
        fp8 = r["mode"].startswith("fp8") and not a.cpu
        rows.append(
            suite.row(
                "precision",
                f"{r['mode']} exploration / merged bf16, speed",
                r["speed_vs_bf16"],
                ">= 1.4x" if fp8 else "-",
                r["speed_vs_bf16"] >= 1.4 if fp8 else None,
            )
        )
    return rows


def step_train(a, tmp: Path) -> list[dict]:
    extra = ["--repeats", "2"] if a.cpu else []
    t = _bench_rollout(a, tmp, "train", extra)["train"]
    target = "-" if a.cpu else ">= 40%"
    return [
        suite.row("train", "training-step seconds", t["seconds"]),
        suite.row(
            "train",
            f"MFU ({t['peak_basis']} peak)",
            100 * t["mfu"],
            target,
            None if a.cpu else t["mfu"] >= 0.4,
        ),
    ]


def step_estimate(a, tmp: Path) -> list[dict]:
    rows = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        match = FITS.search(path.read_text())
        if match:
            n, gb, sharding = match.groups()
            rows.append(
                suite.config_fits(path.stem, int(n), float(gb), "none" if sharding == "ddp" else "fsdp")
            )
    return rows


STEP_FUNCTIONS = {
    "quant": lambda a, tmp: suite.quant_stack(a.cpu),
    "iteration": step_iteration,
    "fsdp": step_fsdp,
    "precision": step_precision,
    "train": step_train,
    "rewards": lambda a, tmp: suite.reward_throughput(a.cpu),
    "estimate": step_estimate,
}


# -- workers (one measurement in a fresh process) -------------------------------------------
def worker(a) -> dict:
    from diffrl.config import load_config

    device = torch.device("cpu" if a.cpu else "cuda")
    with tempfile.TemporaryDirectory() as out:
        if a.worker == "iteration":
            name, sets = suite.iteration_overrides(a.family, a.cpu, out)
            return suite.measure_iteration(load_config(name, sets), device)
        # fsdp: a full fine-tune (fp32 master shards and a sharded reference at start-up)
        family = "sd3"
        name, sets = suite.iteration_overrides(family, a.cpu, out)
        sets += ["model.full_finetune=true", "objective.kl_coef=0.01"]
        return suite.measure_iteration(load_config(name, sets), device, sharding="fsdp")


# -- report -------------------------------------------------------------------------------
def markdown(rows: list[dict]) -> str:
    lines = ["| step | measure | value | target | ok |", "|---|---|---|---|---|"]
    for r in rows:
        value = f"{r['value']:.3f}" if isinstance(r["value"], float) else str(r["value"])
        ok = {True: "yes", False: "**NO**", None: "-"}[r["ok"]]
        lines.append(f"| {r['step']} | {r['measure']} | {value} | {r['target']} | {ok} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny twins on a CPU (what CI runs)")
    p.add_argument("--out", type=Path, default=Path("outputs/gpu_suite"))
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--families", default=",".join(suite.FAMILY_CONFIGS), help="iteration step: families")
    p.add_argument("--worker", choices=("iteration", "fsdp"), help=argparse.SUPPRESS)
    p.add_argument("--family", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    for flag, given, known in (("--steps", a.steps, STEPS), ("--families", a.families, suite.FAMILY_CONFIGS)):
        unknown = [x for x in given.split(",") if x not in known]
        if unknown:
            raise SystemExit(f"error: {flag} {','.join(unknown)}: use a comma list of {', '.join(known)}")
    if a.worker:
        result = worker(a)
        if int(os.environ.get("RANK", "0")) == 0:
            a.json.write_text(json.dumps(result))
        return 0
    if not a.cpu and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here; run scripts/gpu_suite.sh --cpu for the tiny-twin suite")
    from diffrl.perf.hardware import device_name

    device = torch.device("cpu" if a.cpu else "cuda")
    what = "GPU suite (--cpu, tiny twins)" if a.cpu else "GPU suite"
    head = f"{what} on {device_name(device)}, torch {torch.__version__}"
    print(head, flush=True)
    rows, crashed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for step in a.steps.split(","):
            try:
                new = STEP_FUNCTIONS[step](a, Path(tmp))
            except Exception:
                crashed.append(step)
                new = [
                    suite.row(step, "crashed", traceback.format_exc().splitlines()[-1][:200], "runs", False)
                ]
            rows += new
            print(markdown(new).split("\n", 2)[-1], flush=True)
    failed = [r for r in rows if r["ok"] is False and (r["step"] in CHECKS or r["step"] in crashed)]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "suite.md").write_text(f"{head}\n\n{markdown(rows)}\n")
    (a.out / "suite.json").write_text(json.dumps({"head": head, "rows": rows}, indent=1, default=str))
    print(f"\n{head}\n\n{markdown(rows)}\n\nwrote {a.out / 'suite.md'} and {a.out / 'suite.json'}")
    if failed:
        print(f"{len(failed)} check(s) failed: " + "; ".join(r["measure"] for r in failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
