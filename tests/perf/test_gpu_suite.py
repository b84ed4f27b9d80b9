"""What the first H100 run of ``scripts/gpu_suite.py`` found, pinned on a CPU."""

from __future__ import annotations

import pytest
import torch

from diffrl.config import load_config
from diffrl.perf import suite
from diffrl.training.setup import KEEP_CUDNN_ATTENTION, avoid_cudnn_attention


@pytest.mark.parametrize("family", list(suite.FAMILY_CONFIGS))
def test_every_family_s_shrunk_full_size_iteration_is_a_valid_config(family, tmp_path):
    """wan_branchgrpo's tree has 8 leaves per prompt; the suite's group of 2 made its
    iteration a configuration error on the GPU."""
    name, overrides = suite.iteration_overrides(family, cpu=False, output_dir=str(tmp_path))
    cfg = load_config(name, overrides)
    assert cfg.rollout.group_size == 2
    assert cfg.model.height == 256
    assert str(cfg.output_dir) == str(tmp_path)


@pytest.fixture
def cudnn_attention_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_training_turns_cudnn_attention_off(cudnn_attention_restored, monkeypatch):
    monkeypatch.delenv(KEEP_CUDNN_ATTENTION, raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert avoid_cudnn_attention(log=lambda _: None) is True
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert avoid_cudnn_attention(log=lambda _: None) is False  # already off: nothing to do


def test_the_variable_keeps_cudnn_attention(cudnn_attention_restored, monkeypatch):
    monkeypatch.setenv(KEEP_CUDNN_ATTENTION, "1")
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert avoid_cudnn_attention(log=lambda _: None) is False
    assert torch.backends.cuda.cudnn_sdp_enabled()
