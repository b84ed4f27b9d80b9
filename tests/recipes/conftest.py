"""Shared by the step-parity tests: their forwards are of a tiny twin, one or a few rows."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module, restored after it: on a 2-core machine that others
    share, torch's thread per core waiting for one another made these files 8-20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
