"""Prompt overfitting measured (PromptRL): every paraphrase and its original from the same
noise, both judged against the original, in a run's evaluation and in the protocols."""

from __future__ import annotations

import json

import pytest
import torch

from diffrl.evaluation.protocol_run import ProtocolRun, run
from diffrl.evaluation.scoring import evaluate_paraphrases, evaluate_run
from diffrl.evaluation.summary import before_after
from diffrl.inference.session import Session
from tests.helpers import quick_config

LINES = [
    {"prompt": "a red circle", "original": "a red circle", "style": "same"},  # no change: no gap
    {"prompt": "a crimson box", "original": "a red square", "style": "synonyms"},
    {"prompt": "please draw two blue dots", "original": "two blue circles", "style": "register"},
    {"prompt": "a cyan triangle", "original": "a cyan triangle", "style": "same"},
]


@pytest.fixture
def paraphrase_file(tmp_path):
    path = tmp_path / "para.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    return path


def test_the_gap_is_original_minus_paraphrase_pair_by_pair_and_zero_for_an_unchanged_prompt(
    tmp_path, paraphrase_file
):
    cfg = quick_config("toy_flowgrpo", tmp_path, f"eval.paraphrases={paraphrase_file}")
    session = Session(cfg)
    pairs = session.eval_paraphrases
    out = evaluate_paraphrases(session, pairs, cfg)
    assert out["eval_para/n"] == 8  # 4 paraphrases x 2 seeds
    name = "shapeworld_partial"
    mean, original, gap = (out[f"eval_para/{name}/{k}"] for k in ("mean", "original", "gap"))
    assert gap == pytest.approx(original - mean, abs=1e-6)
    # the unchanged prompts score as their originals from the same noise: per style,
    # "same" has the originals' score, so its per-pair gap is 0 exactly
    from diffrl.inference.generate import GenerationSettings, generate_and_score, plan_samples

    direct = generate_and_score(
        session, plan_samples([p.judged for p in pairs], [0, 1], "eval_para"), GenerationSettings.of(cfg)
    )
    same_rows = [x.scores[name] for x in direct if x.sample.index in (0, 3)]
    assert out[f"eval_para/style/same/{name}"] == pytest.approx(sum(same_rows) / 4)
    assert out[f"eval_para/{name}/original"] == pytest.approx(sum(x.scores[name] for x in direct) / 8)
    assert {k.split("/")[2] for k in out if k.startswith("eval_para/style/")} == {
        "same",
        "synonyms",
        "register",
    }


def test_a_run_evaluation_adds_the_paraphrases_and_the_closing_table_shows_them(tmp_path, paraphrase_file):
    cfg = quick_config(
        "toy_flowgrpo", tmp_path, f"eval.paraphrases={paraphrase_file}", "eval.paraphrase_num_prompts=2"
    )
    session = Session(cfg)
    assert [p.judged for p in session.eval_paraphrases] == [
        "a red circle",
        "two blue circles",
    ]  # evenly spaced
    out = evaluate_run(session)
    assert out["eval_para/n"] == 4 and "eval/n" in out
    rows = [{"step": 0, **out}, {"step": 2, **out}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = before_after(metrics)
    assert "paraphrases, judged against their originals" in table
    gap = out["eval_para/shapeworld_partial/gap"]
    assert "eval_para/shapeworld_partial/gap" in table and f"{gap:.4g}" in table


def test_a_paraphrase_whose_original_the_reward_cannot_score_stops_the_session(tmp_path):
    path = tmp_path / "para.jsonl"
    path.write_text(json.dumps({"prompt": "a crimson box", "original": "a crimson box"}) + "\n")
    session = Session(quick_config("toy_flowgrpo", tmp_path, f"eval.paraphrases={path}"))
    with pytest.raises(Exception, match="crimson box"):
        _ = session.eval_paraphrases


def test_the_protocol_scores_originals_and_paraphrases_from_the_same_noise(tmp_path, paraphrase_file):
    request = ProtocolRun(
        protocol="shapeworld",
        config="toy_flowgrpo",
        paraphrases=str(paraphrase_file),
        out=str(tmp_path / "out"),
    )
    result = run(request)
    para = result["paraphrases"]
    assert [s["prompt"] for s in result["samples"][::2]] == [x["original"] for x in LINES]
    assert [s["rendered"] for s in para["samples"][::2]] == [x["prompt"] for x in LINES]
    assert all(s["prompt"] == x["original"] for s, x in zip(para["samples"][::2], LINES))
    for name, gap in para["gap"].items():
        assert gap == pytest.approx(result["headline"][name] - para["headline"][name])
    # an unchanged prompt gives the same verdict from the same noise
    for a, b in zip(result["samples"], para["samples"]):
        if a["index"] in (0, 3):
            assert a["scores"].keys() == b["scores"].keys()
            assert all(
                a["scores"][k] == b["scores"][k] or a["scores"][k] != a["scores"][k] for k in a["scores"]
            )
    table = (tmp_path / "out" / "shapeworld.md").read_text()
    assert "the same prompts paraphrased" in table and "gap (original - paraphrased)" in table
    assert (tmp_path / "out" / "shapeworld_paraphrase_images").is_dir()
    assert (tmp_path / "out" / "shapeworld_images").is_dir()
    with pytest.raises(Exception, match="drop --prompts"):
        run(ProtocolRun(protocol="shapeworld", config="toy_flowgrpo", paraphrases=str(paraphrase_file),
                        prompts="assets/shapeworld/heldout.txt", out=str(tmp_path / "o2")))  # fmt: skip


def test_unchanged_paraphrases_give_the_originals_images(tmp_path, paraphrase_file):
    """The pairing is by noise key: a paraphrase equal to its original is the same image."""
    from diffrl.inference.generate import GenerationSettings, generate_and_score, plan_samples

    session = Session(quick_config("toy_flowgrpo", tmp_path))
    settings = GenerationSettings.of(session.cfg)
    a = generate_and_score(
        session, plan_samples(["a red circle"], [0], "t"), settings, keep_image=lambda p: True
    )
    b = generate_and_score(
        session,
        plan_samples(["a red circle"], [0], "t", rendered=["a red circle"]),
        settings,
        keep_image=lambda p: True,
    )
    assert torch.equal(a[0].image, b[0].image)
