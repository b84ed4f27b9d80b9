"""compare.py on tiny twins: 2 checkpoints x 2 prompts x 2 seeds give the right grid,
HTML and JSONL; identical checkpoints give identical tiles (same noise, same pixels);
RLG columns at w = 0 / 1 equal base / the checkpoint exactly; bad inputs are one error."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from diffrl.config import load_config
from diffrl.data.prompts import PromptFileError
from diffrl.evaluation.compare import CompareError, Tile
from diffrl.evaluation.compare_report import GAP, GROUP_GAP, LABEL_H, grid_pages
from diffrl.models import build_adapter
from diffrl.models.policy import Policy
from tests.helpers import load_script


def _script():
    return load_script("compare")


def _checkpoint(config: str, path: Path, seed: int) -> Path:
    """A diffrl-style checkpoint directory holding perturbed LoRA weights."""
    cfg = load_config(config)
    policy = Policy(build_adapter(cfg.model), cfg.model, cfg.seed)
    g = torch.Generator().manual_seed(seed)
    state = {
        n: p.detach() + 0.2 * torch.randn(p.shape, generator=g)
        for n, p in policy.trainable_named_parameters()
    }
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "trainable.safetensors"))
    return path


@pytest.mark.parametrize("config", ["tiny_toy_flowgrpo", "tiny_flux_flowgrpo"])
def test_grid_html_and_jsonl_have_the_right_shape_and_identical_checkpoints_match(config, tmp_path):
    a = _checkpoint(config, tmp_path / "a", 0)
    b = tmp_path / "b"
    b.mkdir()
    (b / "trainable.safetensors").write_bytes((a / "trainable.safetensors").read_bytes())
    out = _script().main(
        [
            "--config",
            config,
            "--checkpoint",
            "base",
            "--checkpoint",
            f"a={a}",
            "--checkpoint",
            f"b={b}",
            "--num-prompts",
            "2",
            "--seeds",
            "0",
            "1",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "out"),
            "--scale",
            "1",
        ]
    )
    tiles = {(t.prompt_index, t.seed, t.column): t for t in out["tiles"]}
    assert len(tiles) == 2 * 2 * 3
    for p in range(2):
        for s in (0, 1):
            assert torch.equal(tiles[(p, s, "a")].image, tiles[(p, s, "b")].image)
            assert not torch.equal(tiles[(p, s, "a")].image, tiles[(p, s, "base")].image)
            assert all(v == 0 for v in tiles[(p, s, "base")].delta.values())
    rows = [json.loads(line) for line in (tmp_path / "out" / "scores.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {r["checkpoint"] for r in rows} == {"base", "a", "b"}
    tile = tiles[(0, 0, "a")].image
    grid = Image.open(tmp_path / "out" / "grid.png")
    w, h = tile.shape[-1], tile.shape[-2]  # 3 columns x 4 rows of tiles with gutters and captions
    assert grid.size == (GAP + 3 * (w + GAP), GAP + 4 * (h + LABEL_H + GAP))
    # the gutters are white and each tile has a border: tiles never run together
    pixels = np.asarray(grid)
    assert (pixels[:, : GAP - 1] == 255).all() and (pixels[GAP - 1, GAP - 1 : GAP + w] == 150).all()
    page = (tmp_path / "out" / "index.html").read_text()
    body = page.split("<tbody>")[1]
    assert body.count("<tr>") == 4 and body.count("<img ") == 12
    assert len(re.findall(r"onclick='sortBy\(", page)) >= 3


def test_rlg_columns_at_zero_and_one_are_base_and_the_checkpoint(tmp_path):
    a = _checkpoint("tiny_toy_flowgrpo", tmp_path / "a", 1)
    out = _script().main(
        [
            "--config",
            "tiny_toy_flowgrpo",
            "--checkpoint",
            "base",
            "--checkpoint",
            f"a={a}",
            "--rlg-scales",
            "0,1,2",
            "--num-prompts",
            "2",
            "--seeds",
            "3",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    tiles = {(t.prompt_index, t.column): t.image for t in out["tiles"]}
    plain = _script().main(
        [
            "--config",
            "tiny_toy_flowgrpo",
            "--checkpoint",
            f"a={a}",
            "--num-prompts",
            "2",
            "--seeds",
            "3",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "plain"),
        ]
    )
    aligned = {t.prompt_index: t.image for t in plain["tiles"]}
    for p in range(2):
        assert torch.equal(tiles[(p, "a@0")], tiles[(p, "base")])
        assert torch.equal(tiles[(p, "a@1")], aligned[p])
        assert not torch.equal(tiles[(p, "a@2")], aligned[p])


def test_groups_side_by_side_put_each_tile_where_its_group_and_column_say():
    """--groups-per-row 3: 7 prompt groups of 2 columns fill 3 rows of 3 groups (the last
    row part empty); every tile's pixels sit at its group's column and row, and the gap
    between groups is wider than between the columns of one group."""
    w = h = 8
    tiles = [
        Tile(f"prompt {p}", p, 0, column, torch.full((3, h, w), (p * 2 + c + 1) / 20.0))
        for p in range(7)
        for c, column in enumerate(("base", "aligned"))
    ]
    (page,) = grid_pages(tiles, ["base", "aligned"], None, rows_per_page=12, scale=1, groups_per_row=3)
    cell_w, cell_h = w + GAP, h + LABEL_H + GAP
    group_w = 2 * cell_w + GROUP_GAP
    assert page.size == (3 * group_w - GROUP_GAP + GAP, 3 * cell_h + GAP)
    pixels = np.asarray(page)
    for p in range(7):
        for c in range(2):
            x, y = GAP + (p % 3) * group_w + c * cell_w, GAP + (p // 3) * cell_h
            expected = round((p * 2 + c + 1) / 20.0 * 255)
            assert (pixels[y : y + h, x : x + w] == expected).all(), (p, c)
    between_groups = pixels[GAP : GAP + h, GAP + 2 * cell_w - GAP + 1 : GAP + group_w - 1]
    assert between_groups.shape[1] == GROUP_GAP + GAP - 2 and (between_groups == 255).all()
    (one_per_row,) = grid_pages(tiles, ["base", "aligned"], None, rows_per_page=12, scale=1)
    assert one_per_row.size == (GAP + 2 * cell_w, GAP + 7 * cell_h)


def test_bad_inputs_are_one_clear_error(tmp_path, capsys):
    script = _script()
    with pytest.raises(
        CompareError, match="no trainable.safetensors, pytorch_lora_weights.safetensors or transformer"
    ):
        script.main(["--config", "tiny_toy_flowgrpo", "--checkpoint", f"x={tmp_path / 'missing'}"])
    bad = tmp_path / "prompts.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(PromptFileError, match="prompts.jsonl:1: invalid JSON"):
        script.main(["--config", "tiny_toy_flowgrpo", "--checkpoint", "base", "--prompts", str(bad)])
    from diffrl.cli import run_cli

    with pytest.raises(SystemExit) as exit_info:
        run_cli(script.main, ["--config", "tiny_toy_flowgrpo", "--checkpoint", f"x={tmp_path / 'missing'}"])
    assert exit_info.value.code == 2 and "error: checkpoint 'x=" in capsys.readouterr().err
    with pytest.raises(CompareError, match="--num-prompts must be at least 1, got 0"):
        script.main(["--config", "tiny_toy_flowgrpo", "--checkpoint", "base", "--num-prompts", "0"])
    with pytest.raises(CompareError, match="--groups-per-row must be at least 1, got 0"):
        script.main(["--config", "tiny_toy_flowgrpo", "--checkpoint", "base", "--groups-per-row", "0"])
    torn = _checkpoint("tiny_toy_flowgrpo", tmp_path / "torn", seed=0)
    weights = torn / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(
            script.main,
            [
                "--config",
                "tiny_toy_flowgrpo",
                "--checkpoint",
                f"t={torn}",
                "--num-prompts",
                "1",
                "--seeds",
                "0",
                "--out",
                str(tmp_path / "out"),
            ],
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: checkpoint '{torn}': trainable.safetensors has") and "truncated" in err


def test_video_tiles_become_frame_strips_and_gifs(tmp_path):
    a = _checkpoint("tiny_wan_flowgrpo", tmp_path / "a", 2)
    out = _script().main(
        [
            "--config",
            "tiny_wan_flowgrpo",
            "--checkpoint",
            "base",
            "--checkpoint",
            f"a={a}",
            "--num-prompts",
            "1",
            "--seeds",
            "0",
            "--steps",
            "2",
            "--scale",
            "1",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    video = out["tiles"][0].image
    assert video.ndim == 4  # (F, 3, H, W)
    frames = min(4, video.shape[0])
    assert Image.open(tmp_path / "out" / "grid.png").size == (
        GAP + 2 * (frames * video.shape[-1] + GAP),
        GAP + video.shape[-2] + LABEL_H + GAP,
    )
    assert (tmp_path / "out" / "index.html").read_text().count("data:image/gif;base64,") == 2


def test_full_fine_tune_checkpoints_and_their_rlg(tmp_path):
    overrides = ["--set", "model.full_finetune=true"]
    cfg = load_config("tiny_flux_flowgrpo", ["model.full_finetune=true"])
    policy = Policy(build_adapter(cfg.model), cfg.model, cfg.seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.01)
    policy.save_pretrained(tmp_path / "full")
    out = _script().main(
        [
            "--config",
            "tiny_flux_flowgrpo",
            *overrides,
            "--checkpoint",
            "base",
            "--checkpoint",
            f"ft={tmp_path / 'full'}",
            "--rlg-scales",
            "0,1",
            "--num-prompts",
            "1",
            "--seeds",
            "0",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    tiles = {t.column: t.image for t in out["tiles"]}
    assert torch.equal(tiles["ft@0"], tiles["base"]) and not torch.equal(tiles["ft@1"], tiles["base"])
