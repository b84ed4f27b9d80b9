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


def test_an_evaluation_holdout_never_trains_on_what_it_scores(tmp_path):
    """data.eval_holdout (issue 62, item 11: the Wan configs evaluated on their training
    file): the held-out prompts are evenly spaced through the training file, disjoint from
    the prompts trained on, and together they are the file, in order."""
    prompts = [f"a video of scene {i}" for i in range(50)]
    (tmp_path / "train.txt").write_text("\n".join(prompts) + "\n")
    cfg = quick_config(
        "tiny_flux_flowgrpo",
        tmp_path,
        f"data.train_prompts={tmp_path / 'train.txt'}",
        "data.eval_prompts=does/not/exist.txt",
        "data.eval_holdout=5",
        "eval.every=1",
        "eval.num_prompts=5",
    )
    session = Session(cfg, prompts=("train", "eval"))  # the evaluation file is never read
    assert session.eval_prompts == [prompts[i] for i in (0, 10, 20, 30, 40)]
    assert not set(session.eval_prompts) & set(session.train_prompts)
    assert sorted(session.train_prompts + session.eval_prompts, key=prompts.index) == prompts
    assert len(session.train_prompts) == 45


def test_a_holdout_as_large_as_the_training_file_is_refused_before_models_load(tmp_path):
    from diffrl.cli import _check_inputs
    from diffrl.data.prompts import PromptFileError

    (tmp_path / "train.txt").write_text("one\ntwo\nthree\n")
    cfg = quick_config(
        "tiny_flux_flowgrpo",
        tmp_path,
        f"data.train_prompts={tmp_path / 'train.txt'}",
        "data.eval_holdout=3",
        "eval.every=1",
    )
    with pytest.raises(
        PromptFileError, match="data.eval_holdout is 3 but data.train_prompts .* holds 3 prompts"
    ):
        _check_inputs(cfg)


def test_the_wan_configs_hold_their_evaluation_out_of_training():
    """The shipped video configs evaluate on prompts they never train on, and their
    preflight does not ask for an evaluation file they do not read."""
    from diffrl.config import load_config
    from diffrl.data.prompts import prompt_keys
    from diffrl.inference.preflight import prompt_needs

    for name in ("wan22_flowgrpo", "wan_branchgrpo", "wan_videoalign"):
        cfg = load_config(name)
        assert cfg.data.eval_holdout == cfg.eval.num_prompts == 16, name
        assert prompt_keys(cfg) == ["train_prompts"]
        assert [n.what for n in prompt_needs(cfg)] == ["prompt set dancegrpo/video (data.train_prompts)"]
