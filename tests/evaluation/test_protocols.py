"""The papers' evaluation protocols (issue 51, item 3): their tables against the same
numbers computed another way, end to end on the toy with tiny reward twins, chunks dealt
so that N processes give one process's table, and LoRAs from elsewhere."""

from __future__ import annotations

import copy
import json
import statistics

import numpy as np
import pytest
import torch

from diffrl.evaluation import protocols as P
from diffrl.evaluation.protocol_run import ProtocolRun, reward_specs, run
from diffrl.models import tiny

# ShapeWorld captions in GenEval's metadata format (the geneval reward's ShapeWorld twin
# reads them): one line per task kind the twin's vocabulary allows
GENEVAL_LINES = [
    {"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a photo of a circle"},
    {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "red"}],
     "prompt": "a photo of a red square"},
    {"tag": "counting", "include": [{"class": "triangle", "count": 2}],
     "exclude": [{"class": "triangle", "count": 3}], "prompt": "a photo of two triangles"},
    {"tag": "two_object", "include": [{"class": "circle", "count": 1}, {"class": "square", "count": 1}],
     "prompt": "a photo of a circle and a square"},
]  # fmt: skip


def _args(tmp_path, **kw) -> ProtocolRun:
    return ProtocolRun(
        **{"protocol": "shapeworld", "config": "toy_flowgrpo", "out": str(tmp_path / "out"), **kw}
    )


def test_genevals_summary_is_genevals_arithmetic():
    """summary_scores.py: images and prompts correct (a prompt: any of its images), each
    task's accuracy, and the overall score, the unweighted mean over tasks."""
    verdicts = {(0, "counting"): [1, 0], (1, "counting"): [0, 0], (2, "colors"): [1, 1]}
    samples = [
        {"index": i, "group": tag, "seed": s, "scores": {"geneval_correct": float(v), "geneval_strict": 0.0}}
        for (i, tag), vs in verdicts.items()
        for s, v in enumerate(vs)
    ]
    rows = {r[0]: r[1] for r in P.geneval_summary(samples)["rows"]}
    assert rows["images"] == 6 and rows["prompts"] == 3
    assert rows["correct images"] == pytest.approx(3 / 6) and rows["correct prompts"] == pytest.approx(2 / 3)
    assert rows["counting"] == pytest.approx(1 / 4) and rows["colors"] == 1.0
    assert rows["overall (mean over tasks)"] == pytest.approx((1 / 4 + 1) / 2)  # not 3/6


def test_means_have_standard_errors_over_prompts_overall_and_by_group():
    scores = {0: [0.2, 0.4], 1: [0.9, 0.7], 2: [0.1, 0.3]}
    groups = {0: "Colors", 1: "Colors", 2: "Counting"}
    samples = [
        {"index": i, "group": groups[i], "seed": s, "scores": {"pickscore": v}}
        for i, vs in scores.items()
        for s, v in enumerate(vs)
    ]
    rows = {r[0]: r[1:] for r in P.means_summary(samples, ["pickscore"])["rows"]}
    per_prompt = [statistics.mean(v) for v in scores.values()]
    mean, se, n = rows["pickscore"]
    assert mean == pytest.approx(statistics.mean(per_prompt)) and n == 3
    assert se == pytest.approx(statistics.stdev(per_prompt) / 3**0.5)
    assert rows["pickscore / Colors"][0] == pytest.approx(statistics.mean([0.2, 0.4, 0.9, 0.7]))


def test_reward_args_reach_the_protocol_s_rewards_and_bad_ones_are_one_line():
    specs = reward_specs(
        P.PROTOCOLS["geneval"], None, ["geneval.detector=shapeworld", "geneval.threshold=0.4"]
    )
    assert specs == [
        {"name": "geneval", "args": {"score": "geneval", "detector": "shapeworld", "threshold": 0.4}}
    ]
    from diffrl.config import ConfigError

    with pytest.raises(ConfigError, match="use NAME.KEY=VALUE with NAME one of imagereward, pickscore"):
        reward_specs(P.PROTOCOLS["drawbench"], None, ["hps.checkpoint=x"])
    with pytest.raises(ConfigError, match="'hps' is not a reward of protocol drawbench"):
        reward_specs(P.PROTOCOLS["drawbench"], ["hps"], [])
    # DiffusionNFT's UnifiedReward: the judge backend under its own label, its server given
    (judge,) = reward_specs(
        P.PROTOCOLS["drawbench"], ["unifiedreward"], ["unifiedreward.base_url=http://h:1/v1"]
    )
    assert judge["name"] == "vlm_judge" and judge["label"] == "unifiedreward"
    assert judge["args"]["base_url"] == "http://h:1/v1" and judge["args"]["template"] == "unifiedreward"


def test_the_geneval_protocol_end_to_end_on_the_toy(tmp_path):
    prompts = tmp_path / "geneval_shapes.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in GENEVAL_LINES))
    args = _args(
        tmp_path,
        protocol="geneval",
        prompts=str(prompts),
        images=2,
        reward_args=("geneval.detector=shapeworld",),
    )
    result = run(args)
    samples = result["samples"]
    assert len(samples) == 8 and [s["group"] for s in samples[::2]] == [line["tag"] for line in GENEVAL_LINES]
    rows = {r[0]: r[1] for r in result["rows"]}
    for line in GENEVAL_LINES:  # each task's accuracy from the images' own verdicts
        verdicts = [s["scores"]["geneval_correct"] for s in samples if s["group"] == line["tag"]]
        assert rows[line["tag"]] == pytest.approx(sum(verdicts) / 2)
    assert rows["overall (mean over tasks)"] == pytest.approx(
        statistics.mean(rows[t["tag"]] for t in GENEVAL_LINES)
    )
    written = json.loads((tmp_path / "out" / "geneval.json").read_text())
    assert written["rows"] == result["rows"] and written["settings"]["eval_num_steps"] >= 1
    assert written["prompts"] == {"source": str(prompts), "sha256": None, "count": 4}
    assert "| overall (mean over tasks) |" in (tmp_path / "out" / "geneval.md").read_text()
    # the images where GenEval's evaluate_images.py reads them: <index>/metadata.jsonl, samples/
    images = tmp_path / "out" / "geneval_images"
    assert written["images"] == str(images)
    for i, line in enumerate(GENEVAL_LINES):
        assert json.loads((images / f"{i:05d}" / "metadata.jsonl").read_text()) == line
        pngs = sorted(p.name for p in (images / f"{i:05d}" / "samples").iterdir())
        assert pngs == ["00000.png", "00001.png"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig

    from rewards.aesthetic import AestheticMLP

    root = tmp_path_factory.mktemp("protocol_clip")
    tok = tiny.clip_tokenizer()
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=16,
    )
    cfg = CLIPConfig(
        text_config=tiny.clip_text_config(tok, projection_dim=16).to_dict(),
        vision_config=vision.to_dict(),
        projection_dim=16,
    )
    with tiny.seeded(3):
        CLIPModel(cfg).save_pretrained(root / "clip")
        torch.save(AestheticMLP(16).state_dict(), root / "head.pth")
    tok.save_pretrained(root / "clip")
    return root


def test_the_drawbench_protocol_is_diffusionnfts_columns_with_tiny_reward_twins(tmp_path, clip_dir):
    """200 x 5 in DiffusionNFT's table: each column the mean over prompts of the score at its
    scale (PickScore / 26, the CLIP cosine), by category too; every image saved."""
    from PIL import Image

    prompts = tmp_path / "drawbench.csv"
    rows = [
        "Prompts,Category",
        "a red circle,Colors",
        '"two squares, side by side",Counting',
        "a blue triangle,Colors",
    ]
    prompts.write_text("\n".join(rows) + "\n")
    clip = str(clip_dir / "clip")
    reward_args = [
        f"pickscore.pretrained={clip}",
        f"clipscore.pretrained={clip}",
        f"aesthetic.pretrained={clip}",
        f"aesthetic.head={clip_dir / 'head.pth'}",
    ]
    args = _args(
        tmp_path,
        protocol="drawbench",
        prompts=str(prompts),
        rewards=("pickscore", "clipscore", "aesthetic"),
        reward_args=tuple(reward_args),
    )
    result = run(args)
    samples = result["samples"]
    assert len(samples) == 15 and result["images_per_prompt"] == 5
    table = {r[0]: r[1:] for r in result["rows"]}
    for label, key, scale in (("PickScore / 26", "pickscore", 1 / 26), ("CLIP cosine", "clipscore_cosine", 1),
                              ("Aesthetic", "aesthetic", 1)):  # fmt: skip
        per_prompt = [
            statistics.mean(s["scores"][key] * scale for s in samples if s["index"] == i) for i in range(3)
        ]
        mean, se, n = table[label]
        assert mean == pytest.approx(statistics.mean(per_prompt)) and n == 3
        assert se == pytest.approx(statistics.stdev(per_prompt) / 3**0.5)
        colours = [s["scores"][key] * scale for s in samples if s["group"] == "Colors"]
        assert table[f"{label} / Colors"][0] == pytest.approx(statistics.mean(colours))
    assert "HPSv2.1" not in table  # a column whose reward was not asked for is left out
    assert [r["name"] for r in result["settings"]["rewards"]] == ["pickscore", "clipscore", "aesthetic"]
    # the images, in GenEval's layout, are the ones scored: re-scored from the files
    folder = tmp_path / "out" / "drawbench_images" / "00001"
    assert json.loads((folder / "metadata.jsonl").read_text()) == {
        "prompt": "two squares, side by side", "group": "Counting", "Prompts": "two squares, side by side",
        "Category": "Counting"}  # fmt: skip
    assert sorted(p.name for p in (folder / "samples").iterdir()) == [f"{k:05d}.png" for k in range(5)]
    import rewards

    png = torch.tensor(np.asarray(Image.open(folder / "samples" / "00003.png"))).permute(2, 0, 1) / 255
    again = rewards.build("pickscore", pretrained=clip)(png[None], ["two squares, side by side"])["pickscore"]
    scored = next(s for s in samples if s["index"] == 1 and s["seed"] == 3)["scores"]["pickscore"]
    assert again.item() == pytest.approx(scored, abs=0.05)  # through 8-bit PNG


def test_geneval_test_is_diffusionnfts_printout():
    """accuracy: GenEval's verdict averaged over images; each task's over its images; the
    mean over tasks beside it (not the same number when tasks have unequal counts)."""
    verdicts = [("counting", 1, 0), ("counting", 0, 1), ("counting", 0, 0), ("colors", 1, 1)]
    samples = [
        {
            "index": i,
            "group": t,
            "seed": 0,
            "scores": {"geneval_correct": float(c), "geneval_strict": float(s)},
        }
        for i, (t, c, s) in enumerate(verdicts)
    ]
    rows = {r[0]: r[1] for r in P.geneval_image_summary(samples)["rows"]}
    assert rows["accuracy (mean over images)"] == pytest.approx(2 / 4)
    assert rows["strict_accuracy (mean over images)"] == pytest.approx(2 / 4)
    assert rows["counting_accuracy"] == pytest.approx(1 / 3) and rows["colors_accuracy"] == 1.0
    assert rows["overall (mean over tasks)"] == pytest.approx((1 / 3 + 1) / 2)
    assert P.PROTOCOLS["geneval_test"].reward_args["geneval"]["detector_channels"] == "bgr"


# -- LoRAs from elsewhere ----------------------------------------------------------------------
def _toy_peft_lora(tmp_path, rank: int, alpha: float):
    """A random LoRA on the toy transformer in PEFT's format (flow_grpo's), and the PEFT
    model itself (the reference: peft's own loading and forward)."""
    from peft import LoraConfig, get_peft_model

    from diffrl.config import load_config
    from diffrl.models import build_adapter

    adapter = build_adapter(load_config("toy_flowgrpo").model)
    base = copy.deepcopy(adapter.transformer)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False
    )
    with tiny.seeded(5):
        peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(tmp_path / "peft")
    return adapter, peft_model


def _velocity(adapter, model):
    from diffrl.perf.flops import velocity_inputs

    torch.manual_seed(0)  # the same inputs for every model compared
    x, sigma, cond = velocity_inputs(adapter, 2)
    with torch.no_grad():
        return adapter.velocity(model, x, sigma, cond)


def test_a_peft_lora_scores_as_peft_itself_loads_it(tmp_path):
    from diffrl.config import load_config
    from diffrl.models.lora_files import load_outside_lora
    from diffrl.models.policy import Policy

    adapter, peft_model = _toy_peft_lora(tmp_path, rank=4, alpha=8.0)
    expected = _velocity(adapter, peft_model)
    Policy(adapter, load_config("toy_flowgrpo").model)  # the config's own LoRA, which must be off
    lines = []
    load_outside_lora(adapter.transformer, str(tmp_path / "peft"), log=lines.append)
    torch.testing.assert_close(_velocity(adapter, adapter.transformer), expected, rtol=1e-4, atol=1e-5)
    assert "PEFT format" in lines[0] and "the config's own LoRA is off" in lines[0]


def test_a_diffusers_lora_file_scores_as_the_same_weights_in_peft(tmp_path):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from diffrl.models.lora_files import load_outside_lora

    adapter, peft_model = _toy_peft_lora(tmp_path, rank=4, alpha=4.0)  # no alpha in this format: 1x
    expected = _velocity(adapter, peft_model)
    weights = get_peft_model_state_dict(peft_model).items()
    state = {"transformer." + k.removeprefix("base_model.model."): v.contiguous() for k, v in weights}
    (tmp_path / "diffusers").mkdir()
    save_file(state, tmp_path / "diffusers" / "pytorch_lora_weights.safetensors")
    load_outside_lora(adapter.transformer, str(tmp_path / "diffusers"), log=lambda _: None)
    torch.testing.assert_close(_velocity(adapter, adapter.transformer), expected, rtol=1e-4, atol=1e-5)


def test_a_hub_lora_that_cannot_be_fetched_is_one_line(monkeypatch):
    from diffrl.config import ConfigError
    from diffrl.models.lora_files import local_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="hf download jieliu/SD3.5M-FlowGRPO-GenEval --local-dir DIR"):
        local_path("jieliu/SD3.5M-FlowGRPO-GenEval")


class FakeHub:
    """A loopback Hugging Face hub serving one model repository (the four calls
    huggingface_hub's snapshot_download makes: the revision, the file tree, then a HEAD
    and a GET of each file)."""

    SHA = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, repo: str, folder, recursive: bool = False, gated=False):
        import hashlib
        import http.server
        import threading

        found = folder.rglob("*") if recursive else folder.iterdir()
        files = {str(p.relative_to(folder)): p.read_bytes() for p in found if p.is_file()}
        self.requests = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def send(self, body: bytes, content_type: str, headers=()):
                self.send_response(200)
                for key, value in [("Content-Type", content_type), *headers]:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

            def do_GET(self):
                outer.requests.append((self.command, self.path))
                if self.path.split("?")[0] in (f"/api/models/{repo}", f"/api/models/{repo}/revision/main"):
                    siblings = [{"rfilename": f, "size": len(d)} for f, d in files.items()]
                    info = {"id": repo, "sha": outer.SHA, "siblings": siblings, "gated": gated}
                    return self.send(json.dumps(info).encode(), "application/json")
                if self.path.startswith(f"/api/models/{repo}/tree/"):
                    tree = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                            for f, d in files.items()]  # fmt: skip
                    return self.send(json.dumps(tree).encode(), "application/json")
                name = self.path.split("/resolve/", 1)[-1].split("/", 1)[-1]
                if self.path.startswith(f"/{repo}/resolve/") and name in files:
                    etag = [
                        ("ETag", f'"{hashlib.sha1(files[name]).hexdigest()}"'),
                        ("X-Repo-Commit", outer.SHA),
                    ]
                    return self.send(files[name], "application/octet-stream", etag)
                self.send_error(404)

            do_HEAD = do_GET

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_a_hub_lora_id_is_fetched_and_scores_as_the_same_folder(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from diffrl.models.lora_files import load_outside_lora

    adapter, peft_model = _toy_peft_lora(tmp_path, rank=4, alpha=8.0)
    expected = _velocity(adapter, peft_model)
    hub = FakeHub("org/toy-flowgrpo-lora", tmp_path / "peft")
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    try:
        load_outside_lora(adapter.transformer, "org/toy-flowgrpo-lora", log=lambda _: None)
    finally:
        hub.httpd.shutdown()
    torch.testing.assert_close(_velocity(adapter, adapter.transformer), expected, rtol=1e-4, atol=1e-5)
    fetched = {
        path.rsplit("/", 1)[-1] for method, path in hub.requests if method == "GET" and "/resolve/" in path
    }
    assert fetched == {"adapter_config.json", "adapter_model.safetensors"}


def test_the_ocr_protocol_reads_with_paddleocr_as_the_papers_do(monkeypatch):
    """Issue 60, item 6: PaddleOCR by default; where it does not import, one line that
    names the install and the TrOCR fallback (a UserError: no traceback)."""
    import builtins

    from rewards.errors import UserError
    from rewards.ocr_paddle import PaddleOCRMissing, build_engine

    specs = reward_specs(P.PROTOCOLS["ocr"], None, [])
    assert specs == [{"name": "ocr", "args": {"engine": "paddleocr"}}]
    assert reward_specs(P.PROTOCOLS["ocr"], None, ["ocr.engine=trocr"])[0]["args"] == {"engine": "trocr"}
    real_import = builtins.__import__

    def no_paddle(name, *args, **kwargs):
        if name == "paddleocr":
            raise ImportError("No module named 'paddleocr'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_paddle)
    with pytest.raises(PaddleOCRMissing, match=r"pip install 'diffrl\[paddleocr\]'.*or engine: trocr") as err:
        build_engine()
    assert isinstance(err.value, UserError)
