"""Training reports (report.py) overlay runs into a PNG and a summary; evaluations write a
fixed-noise sample sheet per step."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.config import load_config
from diffrl.training.trainer import Trainer
from tests.helpers import load_script


def _script():
    return load_script("report")


def _run(path: Path, solrl: bool, rewards: list[float]):
    path.mkdir(parents=True)
    rows = [{"step": 0, "wall_time": 0.0, "eval/shapeworld_strict/mean": 0.2}]
    for i, r in enumerate(rewards, 1):
        row = {
            "step": i,
            "wall_time": 2.0 * i,
            "reward/mean": r,
            "approx_kl": 1e-6 * i,
            "clipfrac": 0.1,
            "time/update": 1.0,
        }
        if solrl:
            row.update(
                {
                    "time/explore": 2.0,
                    "time/regenerate": 0.5,
                    "solrl/kendall_tau": 0.8,
                    "solrl/spearman_rho": 0.9,
                }
            )
        rows.append(row)
    rows.append({"step": len(rewards), "wall_time": 2.0 * len(rewards), "eval/shapeworld_strict/mean": 0.3})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_overlays_runs_and_summarises(tmp_path):
    _run(tmp_path / "a", False, [0.1 * i for i in range(12)])
    _run(tmp_path / "b", True, [0.05 * i for i in range(12)])
    out = _script().main([f"flow={tmp_path / 'a'}", f"sol={tmp_path / 'b'}", "--out", str(tmp_path / "rep")])
    summary = (out / "summary.md").read_text()
    assert "| flow | 12 |" in summary and "| sol | 12 |" in summary
    assert "0.200 -> 0.300 (0.300)" in summary and "explore 2.00" in summary
    image = Image.open(out / "report.png")
    specs, main = _script().build_panels({"a": _script().load_run(tmp_path / "b")})
    titles = [t for t, _, _ in specs]
    assert (
        main == "eval/shapeworld_strict/mean"
        and "solrl/kendall_tau" in titles
        and "stage seconds: a" in titles
    )
    assert image.size[0] > 0 and image.size[1] >= 240 * ((len(specs) + 2) // 3)


def test_report_without_metrics_is_a_clear_error(tmp_path):
    module = _script()
    with pytest.raises(module.ReportError, match="has no metrics.jsonl"):
        module.main([str(tmp_path)])


def test_every_evaluation_writes_a_sample_sheet(tmp_path):
    cfg = load_config(
        "tiny_toy_flowgrpo",
        [
            f"output_dir={tmp_path}",
            "train.max_steps=1",
            "eval.every=1",
            "eval.at_start=true",
            "eval.num_prompts=2",
            "logging.progress_bar=false",
        ],
    )
    Trainer(cfg).fit()
    sheets = sorted(p.name for p in (tmp_path / "samples").glob("*.png"))
    assert sheets == ["step-0.png", "step-1.png"]
    assert Image.open(tmp_path / "samples" / "step-0.png").size[0] == 4 + 4 * (
        128 + 4
    )  # 4 tiles, 4-px gutters


def test_sheet_captions_wrap_instead_of_being_cut():
    from diffrl.evaluation.plots import CHAR_PX, image_sheet, wrap_caption

    caption = "s0 0.67 a yellow circle to the left of a purple triangle"
    lines = wrap_caption(caption, 128)
    assert " ".join(lines) == caption and all(len(line) * CHAR_PX <= 128 for line in lines)
    long = wrap_caption("word " * 200, 128)
    assert len(long) == 3 and long[-1].endswith("...")
    sheet = image_sheet(torch.rand(2, 3, 8, 8), [caption, "x"], columns=2, tile=128)
    # three caption lines fit under each tile: the caption band below the tiles holds ink
    band = np.asarray(sheet.convert("L"))[4 + 128 + 2 :, 4 : 4 + 128]
    assert (band < 128).any(axis=1).sum() >= 3 * 7  # at least three lines of ~7-px glyphs


def test_video_sheet_shows_every_frame_as_a_strip():
    """A clip's tile is its frames left to right (grey 1-px lines between), so motion shows."""
    from diffrl.evaluation.plots import frame_strip, image_sheet

    clips = torch.zeros(2, 3, 3, 4, 4)  # (N, F, 3, H, W): frame f is lit in channel f
    for f in range(3):
        clips[:, f, f] = 1.0
    strip = frame_strip(clips[0])
    assert strip.shape == (3, 4, 3 * 4 + 2)
    for f in range(3):
        assert torch.equal(strip[:, :, f * 5 : f * 5 + 4], clips[0, f])
    assert torch.allclose(strip[:, :, [4, 9]], torch.full((3, 4, 2), 0.6))
    sheet = image_sheet(clips, ["a", "b"], columns=2, tile=8)
    tile_w = round(8 * 14 / 4)
    assert sheet.size[0] == 4 + 2 * (tile_w + 4)
    pixels = np.asarray(sheet)[4:12, 4 : 4 + tile_w]  # the first tile, nearest-neighbour scaled
    assert (pixels[:, 0] == (255, 0, 0)).all() and (pixels[:, -1] == (0, 0, 255)).all()
