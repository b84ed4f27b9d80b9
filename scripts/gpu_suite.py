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
* ``precision``: FP8 and NVFP4 exploration against a merged BF16 copy raced with it, at
  FLUX.1-dev's widths on 2 double + 4 single blocks, 1024 px, batch 4: FP8 compiled with
  its baseline, NVFP4 (simulated on Hopper: numerics, no speed) eager with its baseline.
* ``train``: training-step time and MFU under the config's autocast, FLUX size.
* ``rewards``: HPSv2.1-size reward throughput on real-size images.
* ``estimate``: every config whose header says ``# fits: N x M GB, ddp|fsdp`` fits it
  (meta-device arithmetic: on a GPU it runs in the background from the start; alone,
  run it with ``--cpu`` or ``--no-time-limits``, the numbers are the same anywhere).

Writes ``suite.md`` (one table) and ``suite.json`` to ``--out`` and exits 1 when a check
fails or a step crashes (a performance target missed is reported, not an error).

On a GPU every step has a time budget (:data:`GPU_BUDGET_S`, 23.8 minutes in all, so the
suite fits 25 on one H100 by construction): a step that runs past it is stopped, its
processes killed, and it is reported as a missed target; the next step runs.
``--no-time-limits`` lifts the budgets (a longer lease); the CPU suite has none.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from diffrl.perf import suite  # noqa: E402
from diffrl.training.setup import FSDP_LAUNCH_ENV  # noqa: E402

STEPS = ("quant", "iteration", "fsdp", "precision", "train", "rewards", "estimate")
CHECKS = ("quant", "iteration", "fsdp", "estimate")  # a False there fails the suite
# seconds each step may take on one H100, 1430 in all: with a grace of GRACE_S per step and
# 30 s to start and report, the suite's 25 minutes. From the first H100 run
# (docs/BENCHMARKS.md): a shrunk full-size iteration took 9-26 s, so about 60-120 s a family
GPU_BUDGET_S = {
    "quant": 90,
    "iteration": 770,
    "fsdp": 120,
    "precision": 240,
    "train": 120,
    "rewards": 60,
    "estimate": 30,
}
FAMILY_LIMIT_S = 180  # one family's iteration, within the step's budget
FP8_SHARE = 0.65  # of the precision budget: the compiled FP8 race (the eager NVFP4 one gets the rest)
CHILD_TIMEOUT_S = 900  # a child's limit where no budget applies (the CPU suite)
GRACE_S = 5  # a step in this process is interrupted this long after its budget (children at it)


class StepTimeout(Exception):
    """A step, or one of its child processes, ran past its time budget."""


class Deadline:
    """The end of a step's time budget (``seconds=None``: no budget)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float | None:
        """Seconds left, at most ``cap``; None without a budget (then ``cap``)."""
        if self.end is None:
            return cap
        left = max(0.0, self.end - time.monotonic())
        return left if cap is None else min(left, cap)


@contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`StepTimeout` in this (main) thread after ``seconds``, for the steps that
    run in this process; children get their own timeouts."""
    if seconds is None:
        yield
        return

    def expire(*_):
        raise StepTimeout(f"ran past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Child:
    """A Python child in its own process group, so that killing it kills what it started
    (torch.distributed.run's workers): a step over its budget leaves nothing on the GPU.
    Its output goes to a file, which a child run in the background cannot fill as a pipe."""

    def __init__(self, args: list[str], env: dict | None = None):
        self.args, self.log = args, tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def wait(self, timeout: float) -> None:
        """Until it exits, at most ``timeout`` seconds (then it is killed); raise if it failed."""
        what = " ".join(self.args[:3])
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise StepTimeout(f"{what} ... ran past {timeout:.0f} s") from None
        finally:
            self.kill()  # on any interruption too (the step's own alarm)
        if self.proc.returncode != 0:
            self.log.seek(0)
            raise RuntimeError(f"{what} ... exited {self.proc.returncode}:\n{self.log.read()[-2500:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _limit(timeout: float | None, what: str) -> float:
    """A child's time limit: ``timeout``, or :data:`CHILD_TIMEOUT_S` without a budget."""
    timeout = CHILD_TIMEOUT_S if timeout is None else timeout
    if timeout <= 0:
        raise StepTimeout(f"{what}: not started, no time left in the budget")
    return timeout


_NAMES = itertools.count()


class Worker(Child):
    """This script as a ``--worker`` child that writes its result as JSON."""

    def __init__(self, args: list[str], tmp: Path, env: dict | None = None, launcher: list[str] = ()):
        self.out = tmp / f"w{next(_NAMES)}.json"
        super().__init__([*launcher, str(Path(__file__)), *args, "--json", str(self.out)], env)

    def result(self, timeout: float) -> dict:
        self.wait(timeout)
        return json.loads(self.out.read_text())


def _worker_json(args, tmp: Path, env=None, launcher=(), timeout: float | None = None) -> dict:
    timeout = _limit(timeout, f"worker {' '.join(args[1:4])}")
    return Worker(args, tmp, env, launcher).result(timeout)


# -- steps --------------------------------------------------------------------------------
def step_iteration(a, tmp: Path) -> list[dict]:
    rows = []
    for family in a.families.split(","):
        left = a.deadline.left(FAMILY_LIMIT_S if a.deadline.seconds else None)
        if left is not None and left <= 0:
            budget = f"the step's {a.deadline.seconds:.0f} s were spent"
            rows.append(suite.row("iteration", f"{family}: not run", budget, "runs", False))
            continue
        flags = ["--worker", "iteration", "--family", family] + (["--cpu"] if a.cpu else [])
        try:
            rows += suite.iteration_rows(family, _worker_json(flags, tmp, timeout=left), a.cpu)
        except Exception as err:  # one family's failure must not hide the others
            rows.append(
                suite.row("iteration", f"{family}: failed", str(err).splitlines()[-1][:200], "runs", False)
            )
    return rows


def step_fsdp(a, tmp: Path) -> list[dict]:
    env = {**FSDP_LAUNCH_ENV, **({"ACCELERATE_USE_CPU": "true"} if a.cpu else {})}
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "1"]
    flags = ["--worker", "fsdp"] + (["--cpu"] if a.cpu else [])
    return suite.fsdp_startup_rows(_worker_json(flags, tmp, env, launcher, a.deadline.left()), 1)


def _bench_rollout(a, tmp: Path, sections: str, extra: list[str]) -> dict:
    out = tmp / f"{sections}.json"
    model = ["--config", "tiny_flux_solrl"] if a.cpu else ["--config", "flux_solrl", "--full-size"]
    args = ["scripts/bench_rollout.py", *model, "--sections", sections, *extra, "--json", str(out)]
    Child(args).wait(_limit(a.deadline.left(), "bench_rollout.py"))
    return json.loads(out.read_text())["results"]


def step_precision(a, tmp: Path) -> list[dict]:
    """One race per call, each in its own process with its share of the budget: on a CPU
    the reference quantizers eager (compiling takes minutes on 2 cores); on a GPU FP8
    compiled with its baseline, then NVFP4 eager with its own."""
    if a.cpu:
        races = [("bf16,fp8:reference,nvfp4:reference", False, 2, None)]
    else:
        budget = a.deadline.seconds
        races = [
            ("bf16,fp8:auto", True, 5, None if budget is None else FP8_SHARE * budget),
            ("bf16,nvfp4:auto", False, 3, None),
        ]
    rows = []
    for modes, compiled, repeats, cap in races:
        flags = ["--worker", "precision", "--modes", modes, "--repeats", str(repeats)]
        flags += (["--cpu"] if a.cpu else []) + (["--compile"] if compiled else [])
        try:
            rows += suite.precision_rows(_worker_json(flags, tmp, timeout=a.deadline.left(cap)), a.cpu)
        except StepTimeout as err:  # a missed target, not a crash: the next race still runs
            rows.append(suite.row("precision", f"{modes} race: stopped", str(err), "within budget", False))
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
    """Every ``# fits:`` promise. Meta-device arithmetic on the CPU (minutes for all the
    configs), so on a GPU it runs in a worker started with the suite, beside the GPU steps,
    and this step only collects it."""
    early = a.background.get("estimate") if hasattr(a, "background") else None
    if early is not None:
        return early.result(a.deadline.left())["rows"]
    return suite.configs_fit(ROOT / "configs")


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
    if a.worker == "estimate":
        return {"rows": suite.configs_fit(ROOT / "configs")}
    if a.worker == "precision":
        name, sets = suite.precision_config(a.cpu)
        cfg = load_config(name, sets)
        batch = cfg.rollout.batch_size if a.cpu else 4
        return suite.measure_precision(cfg, device, a.modes.split(","), batch, a.repeats, a.compile)
    with tempfile.TemporaryDirectory() as out:
        if a.worker == "iteration":
            name, sets = suite.iteration_overrides(a.family, a.cpu, out)
            return suite.measure_iteration(load_config(name, sets), device)
        # fsdp: a full fine-tune (fp32 master shards and a sharded reference at start-up)
        family = "sd3"
        name, sets = suite.iteration_overrides(family, a.cpu, out)
        sets += ["model.full_finetune=true", "objective.kl_coef=0.01"]
        return suite.measure_iteration(load_config(name, sets), device, sharding="fsdp")


# -- running the steps ----------------------------------------------------------------------
def run_step(a, step: str, tmp: Path, budget: float | None) -> list[dict]:
    """One step within ``budget`` seconds: children are killed at the deadline, and a step
    running in this process is interrupted a few seconds after it; either way the step is
    reported as a missed target (its rows so far are lost)."""
    a.deadline = Deadline(budget)
    start = time.monotonic()
    try:
        with time_limit(None if budget is None else budget + GRACE_S):
            return STEP_FUNCTIONS[step](a, tmp)
    except StepTimeout:
        spent = time.monotonic() - start
        return [
            suite.row(step, f"stopped at its {budget:.0f} s budget (seconds)", spent, "within budget", False)
        ]


def run_steps(a, steps: list[str], budgets: dict) -> tuple[list[dict], list[str]]:
    """(rows, crashed steps) of ``steps`` in order, each within ``budgets.get(step)``. With
    budgets (a GPU) and the estimate last after other steps, the estimate starts first in
    the background and may use whatever is left of the suite's time when its turn comes."""
    rows, crashed = [], []
    suite_end = Deadline(sum(budgets.get(s, 0) for s in steps) if budgets else None)
    with tempfile.TemporaryDirectory() as tmp:
        a.background = {}
        if budgets and steps[-1] == "estimate" and len(steps) > 1:
            a.background["estimate"] = Worker(["--worker", "estimate"], Path(tmp))
        try:
            for step in steps:
                budget = suite_end.left() if step in a.background else budgets.get(step)
                try:
                    new = run_step(a, step, Path(tmp), budget)
                except Exception:
                    crashed.append(step)
                    message = traceback.format_exc().splitlines()[-1][:200]
                    new = [suite.row(step, "crashed", message, "runs", False)]
                rows += new
                print(markdown(new).split("\n", 2)[-1], flush=True)
        finally:
            for child in a.background.values():
                child.kill()
    return rows, crashed


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
    p.add_argument("--no-time-limits", action="store_true", help="GPU: lift the per-step time budgets")
    p.add_argument("--worker", choices=("iteration", "fsdp", "precision", "estimate"), help=argparse.SUPPRESS)
    p.add_argument("--family", help=argparse.SUPPRESS)
    p.add_argument("--modes", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
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
    budgets = {} if a.cpu or a.no_time_limits else GPU_BUDGET_S
    rows, crashed = run_steps(a, a.steps.split(","), budgets)
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
