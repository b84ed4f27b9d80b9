"""The inference session (issue 59, item 1): the inputs and the policy of a config or a
checkpoint, with no optimizer, no accelerate.prepare and no training-only patching."""

from __future__ import annotations

import json

import pytest

from diffrl.inference.session import Session
from tests.helpers import quick_config


def test_more_evaluation_prompts_than_the_file_holds_is_said_once(tmp_path):
    """eval.num_prompts beyond the file: every evaluation scores all of it, and the
    session says so once, when the prompts are first read."""
    cfg = quick_config("tiny_flux_flowgrpo", tmp_path, "eval.every=1", "eval.num_prompts=64")
    lines = []
    session = Session(cfg, prompts=("eval",))
    session.acc.print = lines.append
    del session.__dict__["eval_prompts"]  # read again, now that the lines are collected
    assert len(session.eval_prompts) == 4 and len(session.eval_prompts) == 4
    assert lines == [
        "warning: eval.num_prompts is 64 but data.eval_prompts 'assets/prompts/tiny_eval.txt' holds 4: "
        "every evaluation scores all 4"
    ]


def test_a_spaced_evaluation_subset_covers_a_file_sorted_by_category(tmp_path):
    styles = [f"{style} prompt {i}" for style in ("anime", "art", "paint", "photo") for i in range(10)]
    (tmp_path / "bench.json").write_text(json.dumps(styles))
    common = ["eval.every=1", "eval.num_prompts=4", f"data.eval_prompts={tmp_path / 'bench.json'}"]
    spaced = Session(quick_config("tiny_flux_flowgrpo", tmp_path, *common, "eval.subset=spaced"))
    assert spaced.eval_prompts == ["anime prompt 0", "art prompt 0", "paint prompt 0", "photo prompt 0"]
    first = Session(quick_config("tiny_flux_flowgrpo", tmp_path, *common))
    assert first.eval_prompts[:4] == styles[:4]  # first: the file as it is (the evaluation takes the first 4)


def test_a_session_builds_no_optimizer_and_trains_nothing(tmp_path):
    """Nothing training adds: the policy's LoRA is there (a checkpoint loads into it), but
    no optimizer, no prepared model, no precision plan."""
    session = Session(quick_config("tiny_toy_flowgrpo", tmp_path))
    assert session.policy.is_lora and session.policy.trainable_parameters()
    assert not any(hasattr(session, a) for a in ("optimizer", "model", "precision", "rollout_model"))
    assert session.reward_fn.names == [r.key for r in session.cfg.rewards]


def test_a_bad_prompt_set_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="prompt sets"):
        Session(quick_config("tiny_toy_flowgrpo", tmp_path), prompts=("held_out",))
