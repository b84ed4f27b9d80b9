"""Every headline GPU figure in one command, and the same suite on tiny twins on a CPU.

    scripts/gpu_suite.sh --out outputs/gpu_suite                      # every step (about 25 min)
    scripts/gpu_suite.sh --plan first-call --deadline 500 --out DIR    # what scripts/gpu_first_call.py runs
    scripts/gpu_suite.sh --cpu --out /tmp/suite                        # tiny twins on a CPU (CI runs this)

Steps (``--steps``, or a ``--plan``), each measured in its own process, so this process
never holds the GPU and a step that overruns is killed with everything it started:

* ``quant``: torchao and modelopt import and ``auto`` picks them (reference on a CPU);
  each real backend's copy against the reference quantizer's (diffrl.perf.suite).
* ``iteration``: one shrunk full-size iteration per family (tiny twin on a CPU), seconds
  and peak memory against ``estimate_built`` of the same run.
* ``fsdp``: FSDP start-up on one process, a full fine-tune: the peak while the trainer
  is built against the estimate of what exists then.
* ``precision``: FP8 (and NVFP4) exploration against a merged BF16 copy raced with it, at
  FLUX.1-dev size (all blocks where memory allows), 1024 px, batch 4, every copy
  compiled by block alike, compile and warm-up outside the timed rounds; NVFP4
  (simulated on Hopper: numerics, no speed) eager with its own baseline.
* ``train``: training-step time and MFU under the config's autocast, FLUX size (in the
  ``first-call`` plan it runs in the precision step's process, on the same model).
* ``rewards``: HPSv2.1-size reward throughput on real-size images.
* ``estimate``: every config whose header says ``# fits: N x M GB, ddp|fsdp`` fits it
  (meta-device arithmetic, device-independent: on a GPU it runs in the background; the
  first call leaves it to the CPU).

Plans: ``all`` (the steps above, with :data:`GPU_BUDGET_S`) and ``first-call`` (the
headline figures within one 600 s GPU command: precision with the training step, rewards,
then the families flux, sd3, sana, qwenimage and wan22 while time remains).

Output, written the moment each result exists, so a run killed at any point still returns
all that finished: ``suite.md`` (the table, a row appended per result), ``suite.jsonl``
(the same rows, one JSON object per line), ``suite.log`` (every child's output, appended)
and, at the end, ``suite.json``. Exits 1 when a check fails or a step crashes (a
performance target missed is reported, not an error).

On a GPU every step has a time budget, and ``--deadline`` caps the whole suite: a step
that runs past its budget is stopped, its processes killed, and it is reported as a
missed target; a step whose turn comes after the deadline is reported "not run".
``--no-time-limits`` lifts the budgets (a longer lease); the CPU suite has none unless
``--deadline`` is given.
"""

from __future__ import annotations

import argparse
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

from diffrl.perf import suite, suite_precision  # noqa: E402
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
# the first call of a GPU window: the headline figures, in the order they matter; the
# precision step builds FLUX once for the race, the training step and the unified FP8
# training step against it (about 150 + 60 + 70 s)
FIRST_CALL_STEPS = ("precision", "rewards", "iteration")
FIRST_CALL_FAMILIES = "flux,sd3,sana,qwenimage,wan22"
FIRST_CALL_BUDGET_S = {"precision": 330, "rewards": 60, "iteration": 600}
FAMILY_LIMIT_S = 180  # one family's iteration, within the step's budget
FP8_SHARE = 0.65  # of the precision budget: the compiled FP8 race (the eager NVFP4 one gets the rest)
CHILD_TIMEOUT_S = 900  # a child's limit where no budget applies (the CPU suite)
GRACE_S = 5  # a step is interrupted this long after its budget (children at it)
MIN_STEP_S = 20  # on a deadline, a step with less left than this is not started


class StepTimeout(Exception):
    """A step, or one of its child processes, ran past its time budget."""


class Deadline:
    """The end of a time budget (``seconds=None``: no budget)."""

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
    """Raise :class:`StepTimeout` in this (main) thread after ``seconds``; children get
    their own timeouts."""
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


# -- the output folder ---------------------------------------------------------------------
class Report:
    """The suite's output folder, appended to as results arrive: by this process and by
    the workers (one at a time, so lines never interleave). A killed run keeps every line
    written before it died; ``rows()`` reads them back."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.md, self.jsonl, self.log = (self.out / n for n in ("suite.md", "suite.jsonl", "suite.log"))

    def start(self, head: str) -> Report:
        """A new table under ``head`` (an existing log is kept: the first-call driver's)."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.md.write_text(f"{head}\n\n| step | measure | value | target | ok |\n|---|---|---|---|---|\n")
        self.jsonl.write_text("")
        return self

    def add(self, rows: list[dict]) -> None:
        if not rows:
            return
        with self.md.open("a") as md, self.jsonl.open("a") as jsonl:
            md.write("".join(markdown_line(r) + "\n" for r in rows))
            jsonl.write("".join(json.dumps(r, default=str) + "\n" for r in rows))
        print("\n".join(markdown_line(r) for r in rows), flush=True)

    def note(self, text: str) -> None:
        """A line in the log (the driver's own steps, a child's start)."""
        self.out.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:
            log.write(text.rstrip("\n") + "\n")

    def rows(self) -> list[dict]:
        if not self.jsonl.exists():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]


# -- child processes -----------------------------------------------------------------------
class Child:
    """A Python child in its own process group, so that killing it kills what it started
    (torch.distributed.run's workers): a step over its budget leaves nothing on the GPU.
    Its output is appended to the report's log (a file, which a child run in the
    background cannot fill as a pipe, and which comes back however the run ends)."""

    def __init__(self, args: list[str], report: Report, env: dict | None = None):
        self.args = args
        report.note(f"\n==== {time.strftime('%H:%M:%S')} python {' '.join(args)}")
        self.log_path, self.offset = report.log, report.log.stat().st_size
        with report.log.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                stdout=log,
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
            with self.log_path.open() as log:
                log.seek(self.offset)
                tail = log.read()[-2500:]
            raise RuntimeError(f"{what} ... exited {self.proc.returncode}:\n{tail}")

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


def worker_args(a, *flags: str) -> list[str]:
    """This script as a ``--worker`` child writing into the same output folder."""
    return [str(Path(__file__)), "--worker", *flags, "--out", str(a.report.out)] + (
        ["--cpu"] if a.cpu else []
    )


def run_worker(a, flags: list[str], timeout: float | None, env=None, launcher=()) -> None:
    """One worker, which appends its own rows to the report as it measures them (its
    console is the log); this process prints them once it ends, however it ends."""
    timeout = _limit(timeout, f"worker {' '.join(flags[:3])}")
    before = len(a.report.rows())
    try:
        Child([*launcher, *worker_args(a, *flags)], a.report, env).wait(timeout)
    finally:
        for r in a.report.rows()[before:]:
            print(markdown_line(r), flush=True)


def failure_row(step: str, what: str, err: Exception) -> dict:
    lines = str(err).strip().splitlines()
    return suite.row(
        step, f"{what}: failed", (lines[-1] if lines else type(err).__name__)[:200], "runs", False
    )


# -- steps (each returns the rows the workers could not write: failures, skips) -------------
def step_iteration(a) -> list[dict]:
    rows = []
    for family in a.families.split(","):
        left = a.deadline.left(FAMILY_LIMIT_S if a.deadline.seconds else None)
        if left is not None and left < MIN_STEP_S:  # too little to build a model and time it
            spent = f"the step's {a.deadline.seconds:.0f} s were spent"
            rows.append(suite.row("iteration", f"{family}: not run", spent, "runs", None))
            continue
        try:
            run_worker(a, ["iteration", "--family", family], left)
        except Exception as err:  # one family's failure must not hide the others
            rows.append(failure_row("iteration", family, err))
    return rows


def step_fsdp(a) -> list[dict]:
    env = {**FSDP_LAUNCH_ENV, **({"ACCELERATE_USE_CPU": "true"} if a.cpu else {})}
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "1"]
    run_worker(a, ["fsdp"], a.deadline.left(), env, launcher)
    return []


def step_precision(a) -> list[dict]:
    """One race per process, each with its share of the budget: on a CPU the reference
    quantizers eager (compiling takes minutes on 2 cores); on a GPU FP8 compiled by block
    with its baseline (and, with ``a.train_with_precision``, the training step on the
    same model), then, in the full plan, NVFP4 eager with its own."""
    if a.cpu:
        races = [("bf16,fp8:reference,nvfp4:reference", False, 2, None)]
    else:
        budget = a.deadline.seconds
        races = [
            (
                "bf16,fp8:auto",
                True,
                5,
                None if budget is None or a.train_with_precision else FP8_SHARE * budget,
            )
        ]
        if not a.train_with_precision:
            races.append(("bf16,nvfp4:auto", False, 3, None))
    rows = []
    for i, (modes, compiled, repeats, cap) in enumerate(races):
        flags = ["precision", "--modes", modes, "--repeats", str(repeats)] + (
            ["--compile"] if compiled else []
        )
        flags += ["--train"] if a.train_with_precision and i == 0 else []
        try:
            run_worker(a, flags, a.deadline.left(cap))
        except StepTimeout as err:  # a missed target, not a crash: the next race still runs
            rows.append(suite.row("precision", f"{modes} race: stopped", str(err), "within budget", False))
    return rows


def step_estimate(a) -> list[dict]:
    """Every ``# fits:`` promise. Meta-device arithmetic on the CPU (minutes for all the
    configs), so on a GPU it runs in a worker started with the suite, beside the GPU steps,
    and this step only waits for it."""
    early = a.background.get("estimate")
    if early is None:
        run_worker(a, ["estimate"], a.deadline.left())
    else:
        early.wait(_limit(a.deadline.left(), "estimate"))
    return []


STEP_FUNCTIONS = {
    "quant": lambda a: run_worker(a, ["quant"], a.deadline.left()) or [],
    "iteration": step_iteration,
    "fsdp": step_fsdp,
    "precision": step_precision,
    "train": lambda a: run_worker(a, ["train"], a.deadline.left()) or [],
    "rewards": lambda a: run_worker(a, ["rewards"], a.deadline.left()) or [],
    "estimate": step_estimate,
}


# -- workers (one measurement in a fresh process; each appends its rows) ---------------------
def worker(a) -> list[dict]:
    from diffrl.config import load_config

    device = torch.device("cpu" if a.cpu else "cuda")
    report = Report(a.out)
    if a.worker == "quant":
        report.add(suite.quant_stack(a.cpu))
    elif a.worker == "rewards":
        report.add(suite.reward_throughput(a.cpu))
    elif a.worker == "estimate":
        report.add(suite.configs_fit(ROOT / "configs"))
    elif a.worker in ("precision", "train"):
        name, sets = suite_precision.precision_config(a.cpu)
        cfg = load_config(name, sets)
        batch = cfg.rollout.batch_size if a.cpu else 4

        def emit(key: str, value: dict) -> None:
            rows = {"precision": suite_precision.precision_rows, "train": suite_precision.train_rows}
            report.add(rows.get(key, suite_precision.train_precision_rows)(value, a.cpu))

        if a.worker == "train":
            _train_only(cfg, device, a.compile, emit)
        else:
            modes = a.modes.split(",")
            suite_precision.measure_precision(cfg, device, modes, batch, a.repeats, a.compile, emit, a.train)
    else:
        with tempfile.TemporaryDirectory() as out:
            if a.worker == "iteration":
                name, sets = suite.iteration_overrides(a.family, a.cpu, out)
                result = suite.measure_iteration(load_config(name, sets), device)
                report.add(suite.iteration_rows(a.family, result, a.cpu))
            else:  # fsdp: start-up of a full fine-tune (fp32 master shards, a sharded reference)
                name, sets = suite.iteration_overrides("sd3", a.cpu, out)
                sets += ["model.full_finetune=true", "objective.kl_coef=0.01"]
                cfg = load_config(name, sets)
                result = suite.measure_iteration(cfg, device, sharding="fsdp", iterations=False)
                if int(os.environ.get("RANK", "0")) == 0:
                    report.add(suite.fsdp_startup_rows(result, 1))
    return []


def _train_only(cfg, device, compile: bool, emit) -> None:
    """The training step alone (the full plan's ``train`` step), then the same step through
    the unified FP8 flow against it."""
    from diffrl.models import build_adapter
    from diffrl.models.loading import torch_dtype
    from diffrl.models.policy import Policy
    from diffrl.perf import bench
    from diffrl.training.setup import avoid_cudnn_attention

    avoid_cudnn_attention(log=lambda _: None)
    adapter = build_adapter(cfg.model, device=device)
    adapter.to(device)
    Policy(adapter, cfg.model, seed=cfg.seed)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    dtype, guidance, batch = torch_dtype(cfg.model.dtype), cfg.objective.train_cfg, cfg.train.micro_batch_size
    emit("train", bench.training_step(adapter, batch, 2, dtype, guidance, autocast))
    bench.release_memory()
    p = cfg.precision
    emit(
        "train_fp8",
        # eager, as the trainer trains (its compiled blocks are the rollouts')
        bench.training_step_precision(adapter, batch, 2, autocast, guidance, p.backend, p.scaling, False),
    )


# -- running the steps ----------------------------------------------------------------------
def run_step(a, step: str, budget: float | None) -> list[dict]:
    """One step within ``budget`` seconds: children are killed at the deadline, and the
    step itself is interrupted a few seconds after it; either way the step is reported
    as a missed target (the rows its workers wrote stay)."""
    a.deadline = Deadline(budget)
    start = time.monotonic()
    try:
        with time_limit(None if budget is None else budget + GRACE_S):
            return STEP_FUNCTIONS[step](a)
    except StepTimeout:
        spent = time.monotonic() - start
        return [
            suite.row(step, f"stopped at its {budget:.0f} s budget (seconds)", spent, "within budget", False)
        ]


def step_budget(step: str, budgets: dict, suite_end: Deadline) -> float | None:
    """A step's budget: its own, cut to what is left before the suite's deadline."""
    own = budgets.get(step)
    left = suite_end.left()
    if left is None:
        return own
    return left if own is None else min(own, left)


def run_steps(a, steps: list[str], budgets: dict, deadline: float | None = None) -> list[str]:
    """Run ``steps`` in order, each within its budget and all within ``deadline``
    seconds; the rows go to ``a.report`` as they come. Returns the steps that crashed.
    With budgets (a GPU) and the estimate last after other steps, the estimate starts
    first in the background and may use what is left of the suite's time when its turn
    comes."""
    crashed = []
    total = sum(budgets.get(s, 0) for s in steps) if budgets else None
    if deadline is not None:
        total = deadline if total is None else min(total, deadline)
    suite_end = Deadline(total)
    a.background = {}
    if budgets and steps[-1] == "estimate" and len(steps) > 1:
        a.background["estimate"] = Child(worker_args(a, "estimate"), a.report)
    try:
        for step in steps:
            budget = suite_end.left() if step in a.background else step_budget(step, budgets, suite_end)
            if deadline is not None and budget is not None and budget < MIN_STEP_S:
                # not a failed check: the window ended (the row says so; ok stays open)
                left = f"{budget:.0f} s left of the deadline"
                a.report.add([suite.row(step, "not run", left, "runs", None)])
                continue
            try:
                rows = run_step(a, step, budget)
            except Exception:
                crashed.append(step)
                message = traceback.format_exc().splitlines()[-1][:200]
                rows = [suite.row(step, "crashed", message, "runs", False)]
                a.report.note(f"{step} crashed:\n{traceback.format_exc()}")
            a.report.add(rows)
    finally:
        for child in a.background.values():
            child.kill()
    return crashed


# -- report -------------------------------------------------------------------------------
def markdown_line(r: dict) -> str:
    value = f"{r['value']:.3f}" if isinstance(r["value"], float) else str(r["value"])
    ok = {True: "yes", False: "**NO**", None: "-"}[r["ok"]]
    return f"| {r['step']} | {r['measure']} | {value} | {r['target']} | {ok} |"


def markdown(rows: list[dict]) -> str:
    return "\n".join(
        ["| step | measure | value | target | ok |", "|---|---|---|---|---|", *map(markdown_line, rows)]
    )


def version_rows() -> list[dict]:
    """What this run measured with: the device, torch, and every package the steps use."""
    import importlib.metadata as metadata
    import platform

    cuda = torch.version.cuda or "none"
    rows = [
        suite.row("versions", "python", platform.python_version()),
        suite.row("versions", "torch", f"{torch.__version__} (CUDA {cuda})"),
    ]
    for package in (
        "diffusers",
        "transformers",
        "accelerate",
        "peft",
        "torchao",
        "nvidia-modelopt",
        "open_clip_torch",
        "timm",
    ):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "not installed"
        rows.append(suite.row("versions", package, version))
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny twins on a CPU (what CI runs)")
    p.add_argument("--out", type=Path, default=Path("outputs/gpu_suite"))
    p.add_argument(
        "--plan", choices=("all", "first-call"), default="all", help="which steps, budgets and families"
    )
    p.add_argument("--steps", default=None, help=f"comma list of {', '.join(STEPS)} (default: the plan's)")
    p.add_argument("--families", default=None, help="iteration step: families (default: the plan's)")
    p.add_argument("--deadline", type=float, default=None, help="seconds for the whole suite (CPU too)")
    p.add_argument("--no-time-limits", action="store_true", help="GPU: lift the per-step time budgets")
    p.add_argument(
        "--worker",
        choices=("iteration", "fsdp", "precision", "train", "rewards", "quant", "estimate"),
        help=argparse.SUPPRESS,
    )
    p.add_argument("--family", help=argparse.SUPPRESS)
    p.add_argument("--modes", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    return p


def resolve_plan(a) -> tuple[list[str], dict]:
    """(steps, budgets) of ``a``'s plan and flags; fills in ``a.families``."""
    first = a.plan == "first-call"
    steps = (a.steps or ",".join(FIRST_CALL_STEPS if first else STEPS)).split(",")
    a.families = a.families or (FIRST_CALL_FAMILIES if first else ",".join(suite.FAMILY_CONFIGS))
    a.train_with_precision = first and "precision" in steps
    for flag, given, known in (
        ("--steps", steps, STEPS),
        ("--families", a.families.split(","), suite.FAMILY_CONFIGS),
    ):
        unknown = [x for x in given if x not in known]
        if unknown:
            raise SystemExit(f"error: {flag} {','.join(unknown)}: use a comma list of {', '.join(known)}")
    budgets = {} if a.cpu or a.no_time_limits else (FIRST_CALL_BUDGET_S if first else GPU_BUDGET_S)
    return steps, budgets


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    steps, budgets = resolve_plan(a)
    if not a.cpu and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here; run scripts/gpu_suite.sh --cpu for the tiny-twin suite")
    from diffrl.perf.hardware import device_name

    device = torch.device("cpu" if a.cpu else "cuda")
    what = (
        "GPU suite"
        + (" (--cpu, tiny twins)" if a.cpu else "")
        + (", first call" if a.plan == "first-call" else "")
    )
    head = f"{what} on {device_name(device)}, torch {torch.__version__}"
    print(head, flush=True)
    a.report = Report(a.out).start(head)
    a.report.add(version_rows())
    crashed = run_steps(a, steps, budgets, a.deadline)
    rows = a.report.rows()
    failed = [r for r in rows if r["ok"] is False and (r["step"] in CHECKS or r["step"] in crashed)]
    (a.out / "suite.json").write_text(json.dumps({"head": head, "rows": rows}, indent=1, default=str))
    print(
        f"\n{head}\n\n{markdown(rows)}\n\n"
        f"wrote {a.report.md}, {a.report.jsonl}, {a.report.log} and suite.json"
    )
    if failed:
        print(f"{len(failed)} check(s) failed: " + "; ".join(r["measure"] for r in failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
