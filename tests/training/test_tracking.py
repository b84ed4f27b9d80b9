"""W&B as the peers use it (issue 52, item 4), for real: a tiny run logs to W&B in offline
mode, and its run file is read back (W&B's record log: LevelDB's log format of
``wandb.proto`` records): the project and the run's name, the config as hyperparameters,
the evaluation metrics, the sample images with prompt and reward in each caption, the
sheet and the table."""

from __future__ import annotations

import json
import struct

import pytest

from diffrl.config import ConfigError
from diffrl.training.trainer import Trainer
from tests.helpers import quick_config

BLOCK = 32768  # LevelDB log blocks; each record fragment has a 7-byte header


def read_wandb_records(path) -> list:
    """Every record of a ``run-*.wandb`` file, parsed as ``wandb.proto``'s Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, records = path.read_bytes(), 7, b"", []  # 7 bytes: W&B's file header
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        fragment, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        chunks = fragment if kind in (1, 2) else chunks + fragment  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
    return records


def _history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return rows


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    pytest.importorskip("wandb")
    out = tmp_path_factory.mktemp("wandb_run")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    sets = ["logging.trackers=[wandb]", "logging.project=diffrl-test", "logging.tags=[ci]", "eval.every=1",
            "eval.at_start=true", "eval.seeds=[0]", "eval.num_prompts=2"]  # fmt: skip
    cfg = quick_config("tiny_toy_flowgrpo", out, *sets)
    try:
        Trainer(cfg).fit()
    finally:
        mp.undo()
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    return cfg, run_file


def test_the_run_is_named_and_carries_the_config(offline_run):
    cfg, run_file = offline_run
    records = read_wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "diffrl-test" and run.display_name == cfg.run_name and list(run.tags) == ["ci"]
    updates = [u for r in records if r.WhichOneof("record_type") == "config" for u in r.config.update]
    config = {u.key: json.loads(u.value_json) for u in updates}
    assert config["train.max_steps"] == 2 and config["model.family"] == "toy"
    assert json.loads(config["rewards"])[0]["name"] == "shapeworld"


def test_evaluations_log_metrics_images_with_captions_the_sheet_and_the_table(offline_run):
    cfg, run_file = offline_run
    history = _history(read_wandb_records(run_file))
    evaluations = [h for h in history if "eval/shapeworld_strict/mean" in h]
    assert [h["_step"] for h in evaluations] == [0, 1, 2]
    media = [h for h in history if "eval/table/_type" in h]
    assert len(media) == 3 and media[0]["eval/sheet/_type"] == "image-file"
    assert media[0]["eval/table/_type"] == "table-file" and media[0]["eval/table/nrows"] == 2
    table = json.loads((run_file.parent / "files" / media[0]["eval/table/path"]).read_text())
    assert table["columns"][:3] == ["prompt", "seed", "image"] and "shapeworld_strict" in table["columns"]
    prompt = table["data"][0][0]
    captions = media[0]["eval/samples/captions"]
    assert captions[0].startswith(f"{prompt} | shapeworld ") and captions[0].endswith("| seed 0")
    images = list((run_file.parent / "files" / "media" / "images").rglob("*.png"))
    assert len({p.name.split("_")[0] for p in images}) == 2 and len(images) >= 3  # samples and sheets


def test_asking_for_wandb_without_it_is_one_error_at_start(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"'wandb', which is not installed: pip install 'diffrl\[wandb\]'"):
        Trainer(quick_config("tiny_toy_flowgrpo", tmp_path, "logging.trackers=[wandb]"))


def test_evaluation_media_need_no_wandb_when_no_tracker_runs(monkeypatch, tmp_path):
    """With no tracker at all (logging.trackers: []) accelerate answers get_tracker with a
    blank stand-in; the media go nowhere and wandb, absent here, is never imported."""
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises
    cfg = quick_config(
        "tiny_toy_flowgrpo", tmp_path, "logging.trackers=[]", "eval.every=1", "eval.num_prompts=2"
    )
    out = Trainer(cfg).evaluate()
    assert out["eval/n"] == 4 and (cfg.run_dir / "samples" / "step-0.png").is_file()


def test_the_w_and_b_run_id_is_the_run_directory_s_so_a_resume_continues_it(offline_run):
    """Issue 62, item 9: --resume started a second W&B run."""
    cfg, run_file = offline_run
    records = read_wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == (cfg.run_dir / "wandb_run_id").read_text().strip()


def test_a_resume_asks_for_the_same_id_and_wandb_dir_is_obeyed(tmp_path, monkeypatch):
    from diffrl.training.tracking import wandb_init_kwargs

    cfg = quick_config("tiny_toy_flowgrpo", tmp_path / "run", "logging.trackers=[wandb]")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    first = wandb_init_kwargs(cfg)
    assert first["dir"] == str(cfg.run_dir) and first["resume"] == "allow"
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    again = wandb_init_kwargs(cfg)  # the resumed process
    assert again["id"] == first["id"] and again["dir"] == str(tmp_path / "elsewhere")
    other = quick_config("tiny_toy_flowgrpo", tmp_path / "other", "logging.trackers=[wandb]")
    assert wandb_init_kwargs(other)["id"] != first["id"]
