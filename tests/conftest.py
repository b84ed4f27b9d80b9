import os

import pytest

from tests.helpers import CHECKOUT_OUTPUTS, tree_changes, tree_state

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
