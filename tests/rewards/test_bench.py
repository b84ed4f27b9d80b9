"""Reward benchmarking: Pick-a-Pic tie credit on hand cases, preference-file errors, the
shipped ShapeWorld pairs (regenerated identically, and the verifier agrees with every
label), and the CLI's three outputs."""

import json
from pathlib import Path

import pytest
import torch

from diffrl.toy.preferences import write_pairs
from rewards import bench
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "assets" / "reward_bench" / "shapeworld" / "pairs.jsonl"


def test_pairwise_accuracy_gives_pick_a_pic_tie_credit():
    a = torch.tensor([2.0, 1.0, 1.0, 5.0, 3.0])
    b = torch.tensor([1.0, 2.0, 1.05, 5.0, 3.5])
    labels = ["a", "a", "tie", "b", "b"]
    # threshold 0.1: predictions a, b, tie, tie, b -> credits 1, 0, 1, 0.5, 1
    out = bench.pairwise_accuracy(a, b, labels, tie_threshold=0.1)
    assert out["accuracy_with_ties"] == pytest.approx(3.5 / 5)
    # without ties: the tie-labelled pair is dropped; equal scores (pair 4) earn 0.5
    assert out["accuracy_without_ties"] == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert out["tie_pairs"] == 1
    best, acc = bench.best_tie_threshold(a, b, labels)
    assert acc >= out["accuracy_with_ties"] and acc == pytest.approx(
        bench.pairwise_accuracy(a, b, labels, best)["accuracy_with_ties"]
    )


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"prompt": "x", "image_a": "a.png", "image_b": "b.png", "label": "left"}', "label in"),
        ('{"prompt": "x", "image_a": "a.png"}', "missing"),
        ("not json", "invalid JSON"),
        ('{"prompt": "x", "image_a": "nope.png", "image_b": "b.png", "label": "a"}', "does not exist"),
    ],
)
def test_bad_preference_files_name_file_and_line(tmp_path, line, message):
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(SHIPPED.parent.joinpath("images/000_a.png").read_bytes())
    f = tmp_path / "pairs.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(bench.PreferenceFileError, match=f"pairs.jsonl:1: .*{message}"):
        bench.load_pairs(f)


def test_shipped_pairs_regenerate_identically_and_match_the_verifier(tmp_path):
    fresh = write_pairs(tmp_path)
    assert fresh.read_text() == SHIPPED.read_text()
    for row in map(json.loads, SHIPPED.read_text().splitlines()[:6]):
        assert (tmp_path / row["image_a"]).read_bytes() == (SHIPPED.parent / row["image_a"]).read_bytes()
    import rewards

    pairs = bench.load_pairs(SHIPPED)
    images = bench.read_images([p.image_a for p in pairs] + [p.image_b for p in pairs])
    scores = rewards.build("shapeworld", score="strict")(images, [p.prompt for p in pairs] * 2, {})[
        "shapeworld"
    ]
    n = len(pairs)
    acc = bench.pairwise_accuracy(scores[:n], scores[n:], [p.label for p in pairs])
    assert acc["accuracy_with_ties"] == 1.0 and {p.label for p in pairs} == {"a", "b", "tie"}


def test_rank_correlations_of_a_reward_with_itself_are_one():
    s = torch.tensor([0.1, 0.5, 0.3, 0.9])
    out = bench.rank_correlations({"x": s, "y": 2 * s + 1, "z": -s})
    assert out["x vs y"] == {"spearman": pytest.approx(1.0), "kendall": pytest.approx(1.0)}
    assert out["x vs z"]["kendall"] == pytest.approx(-1.0)


def test_cli_writes_json_markdown_and_png(tmp_path, capsys):
    module = load_script("bench_rewards")
    results = module.main(
        ["--out", str(tmp_path), "--batch-sizes", "1", "4", "--repeats", "1", "--device", "cpu"]
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rewards"]["shapeworld"]["pairwise"]["accuracy_without_ties"] == 1.0
    assert [s["batch_size"] for s in saved["rewards"]["jpeg_compressibility"]["speed"]] == [1, 4]
    assert "shapeworld vs jpeg_compressibility" in results["rank_correlations"]
    assert "| shapeworld | 1.000 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="unknown reward 'hpsv9'"):
        module.main(["--reward", "hpsv9", "--out", str(tmp_path), "--no-speed"])


def test_pairs_from_rankings_labels_every_pair_by_rank():
    rows = bench.pairs_from_rankings(
        [{"prompt": "p", "image_path": ["x.png", "y.png", "z.png"], "rank": [2, 1, 2]}], image_root="imgs"
    )
    assert [(r["image_a"], r["image_b"], r["label"]) for r in rows] == [
        ("imgs/x.png", "imgs/y.png", "b"),
        ("imgs/x.png", "imgs/z.png", "tie"),
        ("imgs/y.png", "imgs/z.png", "a"),
    ]


def test_a_truncated_image_in_a_pairs_file_names_the_pair_and_line(tmp_path, capsys):
    good = SHIPPED.parent.joinpath("images/000_a.png").read_bytes()
    (tmp_path / "a.png").write_bytes(good)
    (tmp_path / "b.png").write_bytes(good[: len(good) // 2])  # cut mid-stream
    row = {"prompt": "a red circle", "image_a": "a.png", "image_b": "b.png", "label": "a"}
    (tmp_path / "pairs.jsonl").write_text(
        json.dumps({**row, "image_b": "a.png"}) + "\n" + json.dumps(row) + "\n"
    )
    module = load_script("bench_rewards")
    with pytest.raises(SystemExit) as exit_:
        module.main(
            [
                "--pairs",
                str(tmp_path / "pairs.jsonl"),
                "--reward",
                "jpeg_compressibility",
                "--no-speed",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    message = str(exit_.value)
    assert message.startswith(
        f"error: {tmp_path / 'pairs.jsonl'}:2 (image_b): image '{tmp_path / 'b.png'}' cannot be read"
    )
    assert "\n" not in message
