import os

import pytest

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
