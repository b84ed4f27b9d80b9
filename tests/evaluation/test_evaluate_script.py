"""scripts/evaluate.py scores a checkpoint exactly as the training evaluation did."""

import json

from diffrl.config import load_config
from diffrl.training.trainer import Trainer
from tests.helpers import load_script


def test_evaluating_a_checkpoint_reproduces_the_training_evaluation(tmp_path, capsys):
    # JPEG size varies on random weights, so the groups have signal and the weights move;
    # the verifier (weight 0) still logs its scores and fidelity.
    rewards = "[{name: jpeg_incompressibility, weight: 1.0}, {name: shapeworld, weight: 0.0}]"
    overrides = [
        f"rewards={rewards}",
        "train.max_steps=1",
        "eval.every=1",
        "eval.num_prompts=3",
        "eval.train_num_prompts=2",
        "checkpoint.every=1",
        "logging.progress_bar=false",
    ]
    trainer = Trainer(load_config("tiny_toy_flowgrpo", [f"output_dir={tmp_path / 'run'}", *overrides]))
    logged = trainer.fit()[-1]
    assert logged["optimizer_steps"] > 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-1"
    out = tmp_path / "scores.json"
    evaluate = load_script("evaluate")
    sets = [a for o in overrides for a in ("--set", o)]
    cli = ["--config", "tiny_toy_flowgrpo", *sets]
    evaluate.main([*cli, "--checkpoint", str(checkpoint), "--json", str(out)])
    scored = json.loads(out.read_text())
    for key in (
        "eval/shapeworld/mean",
        "eval/shapeworld/se",
        "eval/fidelity/stray_pixels/mean",
        "eval_train/shapeworld_strict/mean",
        "eval/diversity",
        "eval/n",
    ):
        assert scored[key] == logged[key], key
    assert "eval/fidelity/background_darkness/mean" in capsys.readouterr().out
    # the per-kind breakdown partitions the samples and recombines to the strict accuracy
    kinds = [k for k in ("count", "pair", "relation") if f"eval/shapeworld_kind/{k}/mean" in scored]
    counts = [scored[f"eval/shapeworld_kind/{k}/n"] for k in kinds]
    assert sum(counts) == scored["eval/n"] and len(kinds) == 3
    recombined = (
        sum(n * scored[f"eval/shapeworld_kind/{k}/mean"] for k, n in zip(kinds, counts)) / scored["eval/n"]
    )
    assert abs(recombined - scored["eval/shapeworld_strict/mean"]) < 1e-6
    base = tmp_path / "base.json"
    evaluate.main([*cli, "--checkpoint", "base", "--json", str(base)])
    assert json.loads(base.read_text())["eval/diversity"] != scored["eval/diversity"]  # the weights did load
