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


def _ema_run(tmp_path):
    """A 2-iteration run with an EMA, evaluated at the end: (its logged metrics, checkpoint)."""
    overrides = [
        "rewards=[{name: jpeg_incompressibility, weight: 1.0}, {name: shapeworld, weight: 0.0}]",
        "train.ema_decay=0.5",
        "eval.every=2",
        "eval.num_prompts=3",
        "checkpoint.every=2",
    ]
    from tests.helpers import quick_config

    run = tmp_path / "run"
    trainer = Trainer(quick_config("tiny_toy_flowgrpo", run, *overrides))
    logged = trainer.fit()[-1]
    return logged, run / "checkpoints" / "step-2", overrides


def test_a_run_with_an_ema_scores_under_the_bare_config_name(tmp_path, capsys):
    """Issue 59: the run kept an EMA and the named config has none. Scoring reads neither
    the optimizer nor the RNG state (both deleted here), scores the EMA weights the run's
    evaluation scored, and names the difference in one line."""
    logged, checkpoint, overrides = _ema_run(tmp_path)
    for state in ("optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"):
        (checkpoint / state).unlink()
    evaluate = load_script("evaluate")
    scores = tmp_path / "scores.json"
    sets = [a for o in overrides[:1] + ["eval.num_prompts=3"] for a in ("--set", o)]
    evaluate.main(
        ["--config", "tiny_toy_flowgrpo", *sets, "--checkpoint", str(checkpoint), "--json", str(scores)]
    )
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: config 'tiny_toy_flowgrpo' differs from the checkpoint's own config.yaml: "
        "train.ema_decay is 0.5 there and 0.0 here"
    ]
    assert f"weights: the EMA weights of {checkpoint}" in out
    scored = json.loads(scores.read_text())
    for key in ("eval/shapeworld/mean", "eval/jpeg_incompressibility/mean", "eval/diversity"):
        assert scored[key] == logged[key], key
    # its own config (no --config) scores the same weights; the trained ones differ
    own, trained = tmp_path / "own.json", tmp_path / "trained.json"
    evaluate.main(["--checkpoint", str(checkpoint), "--json", str(own)])
    evaluate.main(["--checkpoint", str(checkpoint), "--weights", "trained", "--json", str(trained)])
    assert json.loads(own.read_text())["eval/diversity"] == scored["eval/diversity"]
    assert json.loads(trained.read_text())["eval/diversity"] != scored["eval/diversity"]


def test_a_config_whose_lora_does_not_fit_the_checkpoint_is_one_line(tmp_path, capsys):
    import pytest

    from diffrl.cli import run_cli

    _, checkpoint, _ = _ema_run(tmp_path)
    evaluate = load_script("evaluate")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(
            evaluate.main,
            ["--config", "tiny_toy_flowgrpo", "--set", "model.lora.rank=8", "--checkpoint", str(checkpoint)],
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert (
        "holds a different model than this config's" in err and "model.lora.rank is 4 there and 8 here" in err
    )
