"""On-policy to the bit on the path real runs take (issue 61): compiled rollouts (inductor,
by block, on this CPU), bf16 / fp16 autocast, the FP8 unified flow, LoRA and full fine-tuning,
CFG; the KL reference exactly equal to the policy before the first update.

The measure is the trainer's own: ``replay/logprob_gap/stepNN``, the training forward's
log-prob against the one stored at sampling, before the iteration's first optimizer step,
and ``kl``, the iteration's mean KL to the reference (one optimizer step per iteration in
these configs, so every KL is taken before it). Exact runs measure at most 1.3e-7 here
(rounding between two fp32 reduction orders); the control with inductor's usual fusion
(``perf.exact_replay=false``) 4e-5 to 3e-4.
"""

import json

import pytest
import torch

from diffrl.training.trainer import Trainer

# the review's two twins: FLUX with bf16 weights (no CFG), SD3 with CFG
TWINS = {"flux": ("model.dtype=bfloat16", "model.guidance_scale=1.0"), "sd3": ()}
ARMS = {
    "bf16": (),
    "unified": ("precision.rollout=fp8", "precision.train=fp8", "precision.backend=reference"),
}
COMPILED = ("perf.compile_rollout=true", "perf.compile_scope=blocks", "train.max_steps=1")


def _last_row(trainer) -> dict:
    lines = (trainer.cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def _replay(tiny_cfg, twin, *sets):
    torch._dynamo.reset()  # every run compiles afresh, as a new process would
    trainer = Trainer(tiny_cfg(twin, *COMPILED, *TWINS[twin], *sets))
    trainer.fit()
    assert trainer.rollout_model.failed is None and trainer.rollout_model.compile_s > 0  # it ran compiled
    row = _last_row(trainer)
    gaps = [v for k, v in row.items() if k.startswith("replay/logprob_gap/step")]
    assert len(gaps) == trainer.cfg.sampling.num_steps
    return gaps, row["kl"]


@pytest.mark.parametrize(
    "twin,arm,autocast",
    [
        ("flux", "bf16", "bf16"),
        ("sd3", "unified", "bf16"),
        ("sd3", "bf16", "fp16"),
        ("flux", "unified", "bf16"),
    ],
)
def test_compiled_rollouts_replay_exactly(tiny_cfg, twin, arm, autocast):
    gaps, kl = _replay(tiny_cfg, twin, f"train.mixed_precision={autocast}", *ARMS[arm])
    assert max(gaps) <= 1e-6, gaps
    if arm == "unified":  # FP8 rounds any difference into whole steps: exact means 0
        assert max(gaps) == 0.0, gaps
    assert kl == 0.0


def test_without_the_emulation_the_compiled_rollouts_are_off_policy(tiny_cfg):
    """The control: inductor's usual fusion skips eager's bf16 roundings."""
    gaps, _ = _replay(tiny_cfg, "flux", "train.mixed_precision=bf16", "perf.exact_replay=false")
    assert max(gaps) > 1e-5, gaps


def test_full_finetune_replays_exactly_and_starts_at_kl_zero(tiny_cfg):
    """Full fine-tuning with fp32 weights: the frozen reference is a copy of the same
    dtypes, so the KL before the first step is exactly 0 (with bf16 weights it is not, and
    the run says so at start: diffrl.training.replay_watch)."""
    gaps, kl = _replay(
        tiny_cfg, "sd3", "train.mixed_precision=bf16", "model.full_finetune=true", *ARMS["unified"]
    )
    assert max(gaps) == 0.0 and kl == 0.0
