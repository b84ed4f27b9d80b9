"""The memory estimate against what a CPU run allocates (issue 37, item 2).

``estimate_built`` sizes a built model by arithmetic on parameter counts and the config
(weights, fp32 master weights with gradients and AdamW moments, the reference copy, EMA
shadows, the exploration copy, encoders, rewards, the trajectory buffer). The measure is
independent of it: every tensor storage the garbage collector reaches right before an
optimizer step of a real training iteration (gradients and moments alive, activations
gone), minus what was alive before the trainer was built."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffrl.config import load_config
from diffrl.perf.estimate import TRANSIENT_PARTS, estimate_built
from diffrl.perf.holdings import PeakBeforeOptimizerStep, live_tensor_bytes
from tests.training.fsdp_memory_probe import MID_SIZE

MIB = 2**20
RUN = ["train.max_steps=2", "eval.every=0", "eval.at_start=false", "checkpoint.every=0"]


@pytest.fixture
def mid_size_toy(monkeypatch):
    """The toy widened to about 9 M parameters (36 MB per fp32 copy), as the FSDP probe does."""
    import diffrl.models.toy as toy

    small = toy.build_components
    monkeypatch.setattr(toy, "build_components", lambda **kw: small(**{**kw, **MID_SIZE}))


def _measured_and_estimated(
    tmp_path: Path, overrides: list[str], config: str = "tiny_toy_flowgrpo"
) -> tuple[int, dict]:
    from diffrl.training.trainer import Trainer

    before = live_tensor_bytes()
    cfg = load_config(config, [f"output_dir={tmp_path}", *RUN, *overrides])
    trainer = Trainer(cfg)
    peak = PeakBeforeOptimizerStep(trainer.optimizer)
    trainer.train_step(0)
    trainer.train_step(1)  # the second step is the first with AdamW's moments alive
    parts = estimate_built(cfg, trainer.adapter, trainer.policy, trainer.reward_fn)
    peak.remove()
    return peak.peak - before, parts


CASES = {
    "lora": [],
    "full fine-tune, KL reference, EMA": [
        "model.full_finetune=true",
        "objective.kl_coef=0.01",
        "train.ema_decay=0.9",
    ],
    "Sol-RL exploration copy": ["solrl.enabled=true"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_matches_what_a_mid_size_run_holds(case, mid_size_toy, tmp_path):
    measured, parts = _measured_and_estimated(tmp_path, CASES[case])
    held = sum(v for k, v in parts.items() if k not in TRANSIENT_PARTS)  # freed before the step
    assert measured > 30 * MIB  # the widened toy really is mid-size
    assert abs(measured - held) <= 0.03 * held + 1 * MIB, (
        measured / MIB,
        {k: v / MIB for k, v in parts.items()},
    )


def test_estimate_matches_what_a_tiny_full_fine_tune_holds(tmp_path):
    measured, parts = _measured_and_estimated(tmp_path, CASES["full fine-tune, KL reference, EMA"])
    held = sum(v for k, v in parts.items() if k not in TRANSIENT_PARTS)
    assert abs(measured - held) <= 0.05 * held + 0.25 * MIB, (
        measured / MIB,
        {k: v / MIB for k, v in parts.items()},
    )


def test_the_inventory_sees_a_tensor_only_while_it_lives():
    before = live_tensor_bytes()
    import torch

    kept = torch.empty(3 * MIB // 4)  # 3 MiB of fp32
    assert live_tensor_bytes() - before == 3 * MIB
    del kept
    assert live_tensor_bytes() == before


def test_the_estimate_counts_buffers(monkeypatch, tmp_path):
    """SD3's position table is a buffer, not a parameter (0.84 GiB at SD3.5 size: the H100
    run measured 0.89 GiB more than an estimate of parameters alone). Here the tiny SD3
    twin's table is widened to 128^2 positions (2 MiB, most of what the run holds)."""
    import diffrl.models.sd3 as sd3

    original = sd3.SD3Transformer2DModel
    monkeypatch.setattr(
        sd3, "SD3Transformer2DModel", lambda **kw: original(**{**kw, "pos_embed_max_size": 128})
    )
    measured, parts = _measured_and_estimated(tmp_path, ["solrl.enabled=true"], "tiny_sd3_flowgrpo")
    held = sum(v for k, v in parts.items() if k not in TRANSIENT_PARTS)
    assert parts["transformer (frozen)"] > 2 * MIB  # the table is counted ...
    assert parts["exploration copy"] > 2 * MIB  # ... in the exploration copy too
    assert abs(measured - held) <= 0.05 * held + 0.25 * MIB, (
        measured / MIB,
        {k: v / MIB for k, v in parts.items()},
    )
