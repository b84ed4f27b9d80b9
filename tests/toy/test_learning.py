"""CI learning test: a short run of the default (flow-GRPO with the velocity anchor) on the
shipped ShapeWorld model must raise the mean verifier reward on fixed held-out prompts and
seeds past a threshold, and must not damage the background (darkness within 1.5x the base).

The run is the default config's first 35 iterations, scored on all held-out prompts x 2
seeds as the default evaluates (the training-prompt subset is skipped to save time); with
fixed noise keys it is deterministic for one torch build and thread count (docs/BENCHMARKS.md).

The control is the same run with the learning rate at 0: the weights cannot move, so its
evaluation after training equals the one before and it must fail the threshold. (Its
length does not matter for that, so CI runs it for 2 iterations; the full-length control
was run once by hand, see the issue-3 closing note.)
"""

import pytest
import torch

from diffrl.config import load_config
from diffrl.trainer import Trainer

STEPS = 35
THRESHOLD = 0.05  # absolute gain in the mean partial score on the held-out eval set


def short_run(tmp_path, lr: float, steps: int, extra: tuple = ()):
    cfg = load_config("toy_flowgrpo", [
        *extra, f"output_dir={tmp_path}", f"train.max_steps={steps}", f"optim.lr={lr}",
        f"eval.every={steps}", "eval.at_start=true", "eval.train_num_prompts=0", "checkpoint.every=0",
        "logging.progress_bar=false",
    ])
    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    history = trainer.fit()
    moved = any(not torch.equal(a, p) for a, p in zip(start, trainer.policy.trainable_parameters()))
    evals = [row for row in history if "eval/shapeworld/mean" in row]
    darkness = evals[-1]["eval/fidelity/background_darkness/mean"] / evals[0]["eval/fidelity/background_darkness/mean"]
    return evals[0]["eval/shapeworld/mean"], evals[-1]["eval/shapeworld/mean"], moved, darkness


@pytest.mark.parametrize("lr, steps, learns", [(None, STEPS, True), (0.0, 2, False)],
                         ids=["default-lr", "lr-0-control"])
def test_short_run_raises_heldout_reward_past_threshold(tmp_path, lr, steps, learns):
    if lr is None:
        lr = load_config("toy_flowgrpo").optim.lr
    # the control's gain is exactly 0 whatever it is scored on, so it is scored on 32 prompts to save time
    extra = () if learns else ("eval.num_prompts=32",)
    before, after, moved, darkness = short_run(tmp_path, lr, steps, extra)
    gain = after - before
    assert moved == learns
    assert (gain >= THRESHOLD) == learns, f"before {before:.3f}, after {after:.3f}, gain {gain:+.3f}"
    assert darkness <= 1.5, f"background darkness {darkness:.2f}x the base: the policy paints the background"
