"""The preflight (issue 52, item 5): everything a run reads is checked before a model is
built, and all that is missing is listed at once, each with the command that fetches what
the run reads (a diffusers pipeline's component folders only), its size and licence gate
where the hub says, once however many processes run."""

from __future__ import annotations

import json

import pytest

from diffrl.config import load_config
from diffrl.inference import preflight as PF

TOY = ["data.train_prompts=assets/prompts/tiny_train.txt", "data.eval_prompts=assets/prompts/tiny_eval.txt"]


def _flux(*sets):
    return load_config("flux_solrl", [*TOY, "data.allow_toy_prompts=true", *sets])


def test_the_pipeline_s_folders_are_what_the_command_fetches():
    assert PF.pipeline_components("flux") == [
        "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer",
    ]  # fmt: skip
    assert PF.pipeline_components("wan22")[-2:] == ["transformer", "transformer_2"]
    (model,) = PF.model_needs(_flux())
    assert PF.command(model) == (
        'hf download black-forest-labs/FLUX.1-dev --include "model_index.json" "scheduler/*" "vae/*" '
        '"text_encoder/*" "tokenizer/*" "text_encoder_2/*" "tokenizer_2/*" "transformer/*"'
    )


def test_everything_missing_is_listed_at_once(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("DIFFRL_DATA", str(tmp_path / "data"))
    rewards = [
        {"name": "hpsv21", "args": {"checkpoint": str(tmp_path / "HPS_v2.1_compressed.pt")}},
        {"name": "reward_server", "args": {"url": "http://127.0.0.1:9"}},
        {"name": "ocr", "args": {"engine": "paddleocr"}},
    ]
    cfg = load_config("flux_solrl", [f"rewards={json.dumps(rewards)}"])  # its prompt sets, not fetched
    needs = PF.preflight(cfg)
    missing = [n.what for n in needs if not n.found]
    import importlib.util

    paddle = [] if importlib.util.find_spec("paddleocr") else ["ocr engine"]
    assert missing == [
        "prompt set hpdv2/train (data.train_prompts)",
        "prompt set hpdv2/benchmark (data.eval_prompts)",
        "model black-forest-labs/FLUX.1-dev (flux)",
        "hpsv21 checkpoint",
        "reward server",
        *paddle,
    ]
    assert PF.blocking(needs) == [n for n in needs if not n.found]  # offline: nothing comes by itself
    text = PF.report(needs)
    assert (
        text.splitlines()[0]
        == f"preflight: {len(needs) - len(missing)} of {len(needs)} found, {len(missing)} missing:"
    )
    for line in ("diffrl-data fetch hpdv2/train", "hf download black-forest-labs/FLUX.1-dev --include",
                 "start the server that answers http://127.0.0.1:9"):  # fmt: skip
        assert line in text


def _cache_snapshot(cache, repo: str, files: dict[str, str]):
    """A hub cache entry as huggingface_hub lays it out: refs/main -> snapshots/<sha>/..."""
    sha = "a" * 40
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    for name, text in files.items():
        path = root / "snapshots" / sha / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "snapshots" / sha


def test_a_cached_pipeline_is_found_and_a_missing_shard_is_not(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
    files = {"model_index.json": "{}"}
    for component in PF.pipeline_components("flux"):
        files[f"{component}/config.json"] = "{}"
    index = {"weight_map": {"a": "diffusion_pytorch_model-00001-of-00002.safetensors",
                            "b": "diffusion_pytorch_model-00002-of-00002.safetensors"}}  # fmt: skip
    files["transformer/diffusion_pytorch_model.safetensors.index.json"] = json.dumps(index)
    files["transformer/diffusion_pytorch_model-00001-of-00002.safetensors"] = "x"
    snapshot = _cache_snapshot(tmp_path / "cache", "black-forest-labs/FLUX.1-dev", files)
    (model,) = PF.model_needs(_flux())
    assert not PF.check(model)  # shard 2 of 2 is missing
    (snapshot / "transformer" / "diffusion_pytorch_model-00002-of-00002.safetensors").write_text("x")
    assert PF.check(model)


def test_online_a_missing_hub_file_is_sized_gated_and_left_to_the_run(tmp_path, monkeypatch):
    """The hub says each repository's size (of what the command fetches: not the
    repository's single-file checkpoints) and its gate; the run downloads it itself."""
    import huggingface_hub.constants as hub

    from tests.evaluation.test_protocols import FakeHub

    folder = tmp_path / "repo"
    for name, size in {
        "model_index.json": 2,
        "transformer/x.safetensors": 3000,
        "flux1-dev.safetensors": 9000,
    }.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x" * size)
    fake = FakeHub("black-forest-labs/FLUX.1-dev", folder, recursive=True, gated="manual")
    monkeypatch.setattr(hub, "ENDPOINT", fake.url)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
    try:
        (model,) = PF.model_needs(_flux())
        model.found = PF.check(model)
        PF.hub_details(model)
    finally:
        fake.httpd.shutdown()
    assert not model.found and model.size_gb == pytest.approx(3002 / 1e9)
    assert model.gated.startswith(
        "gated (manual): accept the licence at https://huggingface.co/black-forest-labs/FLUX.1-dev"
    )
    assert PF.blocking([model]) == []  # online: the run fetches it


def test_a_start_with_something_missing_says_it_once_with_all_of_it(tmp_path, capsys, monkeypatch):
    from diffrl.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
    args = [
        "--config",
        "flux_solrl",
        *[a for s in TOY for a in ("--set", s)],
        "--set",
        "data.allow_toy_prompts=true",
    ]
    assert main([*args, "--set", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("error: preflight:") == 1 and "Traceback" not in err
    assert (
        "hf download xswu/HPSv2 HPS_v2.1_compressed.pt" in err
        and "hf download black-forest-labs/FLUX.1-dev" in err
    )
    assert main([*args, "--preflight"]) == 2
    assert "MISSING  hpsv21 checkpoint" in capsys.readouterr().out


def test_each_thing_is_listed_once_and_videoalign_s_base_and_template_are_listed(tmp_path, monkeypatch):
    """Issue 62, item 4: a set that is both the training and the evaluation set, and the
    files one tokenizer repository gives two rewards, were listed again and again; what
    VideoAlign reads besides its release (the Qwen2-VL base's config and processor, the
    pinned template) was not listed; Wan's number arguments were called folders."""
    monkeypatch.setenv("DIFFRL_DATA", str(tmp_path / "data"))
    rewards = "rewards=[{name: videoalign}, {name: pickscore}, {name: pickscore, weight: 0.5}]"
    same_set = ["data.eval_prompts=dancegrpo/video", "data.eval_holdout=0"]  # one set for both
    cfg = load_config("wan_videoalign", [rewards, *same_set])
    needs = PF.gather(cfg)
    sets = [n for n in needs if n.prompt_set == "dancegrpo/video"]
    assert len(sets) == 1 and "data.train_prompts" in sets[0].what and "data.eval_prompts" in sets[0].what
    laion = [n for n in needs if n.repo == "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"]
    assert len(laion) == 1 and {"vocab.json", "merges.txt"} <= set(laion[0].files)
    base = [n for n in needs if n.repo == "Qwen/Qwen2-VL-2B-Instruct"]
    assert len(base) == 1 and {"config.json", "preprocessor_config.json"} <= set(base[0].files)
    (template,) = [n for n in needs if n.what == "videoalign prompt template"]
    assert template.download_url.endswith("/prompt_template.py") and template.path.endswith(".py")
    assert len({PF.command(n) for n in needs}) == len(needs)  # no line twice
    assert "boundary_ratio" not in PF.pipeline_components("wan22")


def test_a_missing_local_model_folder_gets_the_family_s_download_into_that_folder(tmp_path):
    """Issue 62, item 4: a local model path used to get a generic `hf download REPO --include
    ... --local-dir DIR`; now the family's published checkpoint, the exact folders the
    pipeline loads and the configured folder, with the family's other checkpoints named."""
    folder = tmp_path / "models" / "flux-dev"
    (need,) = PF.model_needs(load_config("flux_flowgrpo", [f"model.pretrained={folder}"]))
    text = PF.command(need)
    assert text.startswith("hf download black-forest-labs/FLUX.1-dev --include ") and "REPO" not in text
    assert f"--local-dir {folder}" in text and text.endswith("(or black-forest-labs/FLUX.1-schnell)")
    for component in PF.pipeline_components("flux"):
        assert f'"{component}/*"' in text
    (sd3,) = PF.model_needs(load_config("sd35_flowgrpo", [f"model.pretrained={tmp_path / 'sd35'}"]))
    assert "stable-diffusion-3.5-large" in PF.command(sd3) and "stable-diffusion-3.5-medium" in PF.command(
        sd3
    )


def test_the_refiner_lm_is_listed_with_its_tokenizer_and_chat_template(tmp_path, monkeypatch):
    """PromptRL's refiner: a hub LM is one need with its weights, tokenizer and chat
    template; a missing local folder names the folder; the shipped and tiny ones need nothing."""
    monkeypatch.setenv("DIFFRL_DATA", str(tmp_path / "data"))
    needs = PF.gather(load_config("flux_promptrl"))
    (lm,) = [n for n in needs if "refiner.model" in n.what]
    assert lm.repo == "Qwen/Qwen2.5-VL-3B-Instruct" and {"*.safetensors", "*.json", "*.jinja"} <= set(
        lm.includes
    )
    (local,) = PF.refiner_needs(load_config("flux_promptrl", [f"refiner.model={tmp_path / 'qwen'}"]))
    assert local.path == str(tmp_path / "qwen") and not PF.check(local)
    assert f"--local-dir {tmp_path / 'qwen'}" in local.fix
    assert PF.refiner_needs(load_config("toy_promptrl")) == []
