import os

import pytest

from tests.helpers import CHECKOUT_OUTPUTS, tree_changes, tree_state

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _worker_threads() -> int | None:
    """Under pytest-xdist (pyproject's addopts) each worker's share of the cores; None when
    the tests run in one process. torch's default of one thread per core in every worker
    oversubscribes the cores, and threads that wait for a core held by another worker slow
    a test down tenfold: on the 2-core machine, two workers without the per-test reset
    below took 17 min for the quick tier (the toy pretraining test, which sets 2 threads
    through the toy CLI, 103 s against 9 s), and 8 min with it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


WORKER_THREADS = _worker_threads()
if WORKER_THREADS is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))

FAMILIES = [
    "flux",
    "flux_kontext",
    "flux2",
    "qwenimage",
    "qwenimage_edit",
    "sd3",
    "sana",
    "wan",
    "wan22",
    "toy",
]


@pytest.fixture
def tiny_cfg(tmp_path):
    """Load a tiny family config with a temporary output_dir and quick settings."""
    from tests.helpers import quick_config

    def make(family="flux", *overrides):
        return quick_config(f"tiny_{family}_flowgrpo", tmp_path / family, *overrides)

    return make


@pytest.fixture(autouse=True)
def _threads_within_the_worker_s_share():
    """Every test starts at the worker's share, and whatever a test set (the toy CLI's
    --threads, a golden run's count) is undone before the next one."""
    if WORKER_THREADS is None:
        yield
        return
    import torch

    torch.set_num_threads(WORKER_THREADS)
    yield
    torch.set_num_threads(WORKER_THREADS)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps a process-wide singleton; reset it so each test may pick its own
    mixed precision."""
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


# Tests never read or write the checkout's outputs/ (issue 40, item 4): a user's own runs
# live there (outputs/<run_name> is the CLI's default run directory), and a test that used
# it both broke after a README run and could delete or append to the user's work. Each
# test is checked on its own (two levels deep: cheap, and names the test), the session as
# a whole at its end (every file, for an in-place write the shallow look misses). Reads
# leave no trace: test_launch.py's CLI tests run from fresh directories, and their error
# cases from one already holding a run in its default output_dir.
_GUARD_HINT = (
    "tests write to tmp_path (--set output_dir=..., --out ..., or a subprocess with cwd=tmp_path); "
    "if something outside the tests wrote to outputs/ meanwhile, that is the cause: run again"
)


def _outputs_untouched(before: dict, after: dict, who: str) -> None:
    changes = tree_changes(before, after)
    if changes:
        shown = "\n  ".join(changes[:20]) + ("\n  ..." if len(changes) > 20 else "")
        pytest.fail(f"{who} changed {CHECKOUT_OUTPUTS}:\n  {shown}\n{_GUARD_HINT}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _session_leaves_checkout_outputs_alone():
    before = tree_state(CHECKOUT_OUTPUTS)
    yield
    _outputs_untouched(before, tree_state(CHECKOUT_OUTPUTS), "the test session")


@pytest.fixture(autouse=True)
def _test_leaves_checkout_outputs_alone(request):
    before = tree_state(CHECKOUT_OUTPUTS, depth=2)
    yield
    _outputs_untouched(before, tree_state(CHECKOUT_OUTPUTS, depth=2), request.node.nodeid)
