"""CI learning test: a short run of the default (flow-GRPO with the velocity anchor) on the
shipped ShapeWorld model must raise the share of held-out samples whose objects are all
right (``shapeworld_clause/objects``, what RL improves on this model; docs/BENCHMARKS.md,
"Why every recipe stops near 0.45") past a threshold, and must not damage the background
(darkness within 1.5x the base).

Measured with torch 2.14.1 at 2 threads: objects right 0.639 -> 0.656 (10) -> 0.697 (20
iterations), partial score 0.651 -> 0.684; the threshold 0.03 leaves about 0.03 of margin.
The run is the default config's first 20 iterations, scored on all held-out prompts x 2
seeds as the default evaluates (the training-prompt subset is skipped to save time); with
fixed noise keys it is deterministic for one torch build and thread count (docs/BENCHMARKS.md).

The control is the same run with the learning rate at 0: the weights cannot move, so its
evaluation after training equals the one before and it must fail the threshold. (Its
length does not matter for that, so CI runs it for 1 iteration scored on 8 prompts; the
full-length control was run once by hand, see the issue-3 closing note.)
"""

import pytest
import torch

from diffrl.config import load_config
from diffrl.training.trainer import Trainer

STEPS = 20
THRESHOLD = 0.03  # absolute gain in the share of held-out samples with every object right
METRIC = "eval/shapeworld_clause/objects/mean"


def short_run(tmp_path, lr: float, steps: int, extra: tuple = ()):
    cfg = load_config(
        "toy_flowgrpo",
        [
            *extra,
            f"output_dir={tmp_path}",
            f"train.max_steps={steps}",
            f"optim.lr={lr}",
            f"eval.every={steps}",
            "eval.at_start=true",
            "eval.train_num_prompts=0",
            "checkpoint.every=0",
            "logging.progress_bar=false",
        ],
    )
    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    history = trainer.fit()
    moved = any(not torch.equal(a, p) for a, p in zip(start, trainer.policy.trainable_parameters()))
    evals = [row for row in history if METRIC in row]
    darkness = (
        evals[-1]["eval/fidelity/background_darkness/mean"]
        / evals[0]["eval/fidelity/background_darkness/mean"]
    )
    return evals[0][METRIC], evals[-1][METRIC], moved, darkness


@pytest.mark.parametrize(
    "lr, steps, learns", [(None, STEPS, True), (0.0, 1, False)], ids=["default-lr", "lr-0-control"]
)
def test_short_run_raises_heldout_reward_past_threshold(tmp_path, lr, steps, learns):
    if lr is None:
        lr = load_config("toy_flowgrpo").optim.lr
    # the control's gain is exactly 0 whatever it is scored on, so it is scored on 8 prompts to save time
    extra = () if learns else ("eval.num_prompts=8",)
    before, after, moved, darkness = short_run(tmp_path, lr, steps, extra)
    gain = after - before
    assert moved == learns
    assert (gain >= THRESHOLD) == learns, f"before {before:.3f}, after {after:.3f}, gain {gain:+.3f}"
    assert darkness <= 1.5, f"background darkness {darkness:.2f}x the base: the policy paints the background"
