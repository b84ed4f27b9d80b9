"""CLIP-family rewards (HPSv2/2.1, PickScore, CLIPScore, LAION aesthetic) on tiny random models.

Each tiny model is written in its official checkpoint format (HPS: ``{'state_dict': open_clip
CLIP state dict}``; PickScore/CLIPScore: a transformers ``save_pretrained`` directory;
aesthetic: a plain ``layers.N.*`` state dict) and loaded through the real loader.
"""

import json
import re

import open_clip
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig

import rewards
from diffrl.models import tiny
from rewards import aesthetic as aesthetic_mod
from rewards.aesthetic import AestheticMLP, LaionAesthetic
from rewards.clip_common import (
    MissingRewardWeightsError,
)
from rewards.clipscore import CLIPScore
from rewards.hps import HPSv2, HPSv21
from rewards.images import RewardInputError
from rewards.pickscore import PickScore

TINY_OPENCLIP = "tiny-ViT-H-14-diffrl-test"
PROMPTS = ["a red cat", "two dogs on a beach", "a house at night", "blue sky"]


# ----------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Every tiny checkpoint, written once per module in its official format."""
    root = tmp_path_factory.mktemp("clip_weights")
    # ViT-H-14's config shape with tiny widths and one layer per tower; the real BPE vocab size
    # so open_clip's bundled tokenizer works
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    (root / f"{TINY_OPENCLIP}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(root / f"{TINY_OPENCLIP}.json")
    with tiny.seeded(0):
        hps = open_clip.create_model(TINY_OPENCLIP, pretrained=None)
    torch.save({"state_dict": hps.state_dict()}, root / "HPS_v2_compressed.pt")

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
    clip_cfg = CLIPConfig(
        text_config=tiny.clip_text_config(tok, projection_dim=16).to_dict(),
        vision_config=vision.to_dict(),
        projection_dim=16,
        logit_scale_init_value=3.0,
    )
    with tiny.seeded(1):
        clip = CLIPModel(clip_cfg)
    clip.save_pretrained(root / "clip")
    tok.save_pretrained(root / "clip")
    clip.save_pretrained(root / "clip_no_tokenizer")
    with tiny.seeded(2):
        head = AestheticMLP(16)
    torch.save(head.state_dict(), root / "head.pth")
    return root


@pytest.fixture(scope="module")
def models(weights):
    return {
        "hpsv2": HPSv2(checkpoint=str(weights / "HPS_v2_compressed.pt"), model_name=TINY_OPENCLIP),
        "pickscore": PickScore(pretrained=str(weights / "clip")),
        "clipscore": CLIPScore(pretrained=str(weights / "clip")),
        "aesthetic": LaionAesthetic(pretrained=str(weights / "clip"), head=str(weights / "head.pth")),
    }


def images(n=4, h=40, w=56, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, h, w, generator=g)


def smooth_pil(h, w, seed):
    """A low-frequency image (what generators produce), as uint8 PIL."""
    low = torch.rand(1, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    img = F.interpolate(low, size=(h, w), mode="bilinear", align_corners=True)[0]
    return Image.fromarray((img * 255).round().byte().permute(1, 2, 0).numpy())


# ----------------------------------------------------------------------------- every family

FAMILIES = ["hpsv2", "pickscore", "clipscore", "aesthetic"]


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_shape_finite_and_batch_invariant(models, family):
    reward, x = models[family], images()
    out = reward(x, PROMPTS, {})
    assert family in out and all(v.shape == (4,) and v.dtype == torch.float32 for v in out.values())
    assert all(torch.isfinite(v).all() for v in out.values())
    singles = [reward(x[i : i + 1], PROMPTS[i : i + 1], {}) for i in range(4)]
    for key, value in out.items():
        torch.testing.assert_close(torch.cat([s[key] for s in singles]), value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_internal_chunking_does_not_change_scores(models, family):
    reward, x = models[family], images(5)
    full = reward(x, PROMPTS + ["one more"], {})[family]
    reward.batch_size, old = 2, reward.batch_size
    try:
        chunked = reward(x, PROMPTS + ["one more"], {})[family]
    finally:
        reward.batch_size = old
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_reaches_input_images(models, family):
    x = images(2).requires_grad_(True)
    with torch.enable_grad():
        models[family](x, PROMPTS[:2], {})[family].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_inputs_are_clear_errors(models, family):
    with pytest.raises(RewardInputError, match=r"got shape \(2, 40, 40\)"):
        models[family](torch.rand(2, 40, 40), PROMPTS[:2], {})
    with pytest.raises(RewardInputError, match="video"):
        models[family](torch.rand(2, 3, 3, 32, 32), PROMPTS[:2], {})
    if family != "aesthetic":
        with pytest.raises(RewardInputError, match="one prompt per image"):
            models[family](images(2), PROMPTS[:1], {})


@pytest.mark.parametrize("family", FAMILIES)
def test_pil_input_matches_tensor_input(models, family):
    x = (images(2) * 255).round() / 255
    pil = [Image.fromarray((im * 255).round().byte().permute(1, 2, 0).numpy()) for im in x]
    torch.testing.assert_close(
        models[family](pil, PROMPTS[:2], {})[family],
        models[family](x, PROMPTS[:2], {})[family],
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_reduced_precision_and_to(weights, models, family):
    make = {
        "hpsv2": lambda **kw: HPSv2(
            checkpoint=str(weights / "HPS_v2_compressed.pt"), model_name=TINY_OPENCLIP, **kw
        ),
        "pickscore": lambda **kw: PickScore(pretrained=str(weights / "clip"), **kw),
        "clipscore": lambda **kw: CLIPScore(pretrained=str(weights / "clip"), **kw),
        "aesthetic": lambda **kw: LaionAesthetic(
            pretrained=str(weights / "clip"), head=str(weights / "head.pth"), **kw
        ),
    }[family]
    x, ref = images(2), models[family](images(2), PROMPTS[:2], {})[family]
    low = make(dtype="bfloat16")(x, PROMPTS[:2], {})[family]
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, ref, atol=0.05 * max(1.0, ref.abs().max().item()), rtol=0)
    reward = make()
    assert reward.to("cpu", "float16") is reward and reward.dtype == torch.float16
    assert reward.to(dtype=torch.float32)(x, PROMPTS[:2], {})[family].shape == (2,)
    with pytest.raises(ValueError, match="dtype"):
        make(dtype="int8")


def test_build_through_registry(weights, monkeypatch):
    monkeypatch.setitem(rewards.REWARDS._entries, "clipscore", "rewards.clipscore:CLIPScore")
    reward = rewards.build("clipscore", pretrained=str(weights / "clip"), batch_size=2)
    assert reward(images(3), PROMPTS[:3], {})["clipscore"].shape == (3,)


# ----------------------------------------------------------------------------- HPSv2


def test_hps_checkpoint_has_vit_h_14_layout(weights):
    """The tiny file has exactly ViT-H-14's keys (up to the number of blocks), under 'state_dict'."""
    from open_clip.model import CLIP

    with torch.device("meta"):
        real = CLIP(**open_clip.get_model_config("ViT-H-14"))
    pattern = lambda keys: {re.sub(r"resblocks\.\d+\.", "resblocks.N.", k) for k in keys}  # noqa: E731
    ckpt = torch.load(weights / "HPS_v2_compressed.pt", map_location="cpu", weights_only=True)
    assert list(ckpt) == ["state_dict"]
    assert pattern(ckpt["state_dict"]) == pattern(real.state_dict())


def test_hps_score_is_the_official_diagonal_cosine(models):
    reward, x = models["hpsv2"], images(3)
    with torch.no_grad():
        pixels = reward.preprocess(x)
        tokens = open_clip.get_tokenizer(TINY_OPENCLIP)(PROMPTS[:3])
        image_features, text_features, _ = reward.model(pixels, tokens)  # open_clip normalises both
        official = torch.diagonal(image_features @ text_features.T)
        raw = F.cosine_similarity(reward.model.encode_image(pixels), reward.model.encode_text(tokens))
    score = reward(x, PROMPTS[:3], {})["hpsv2"]
    torch.testing.assert_close(score, official, atol=1e-5, rtol=0)
    torch.testing.assert_close(score, raw, atol=1e-5, rtol=0)


def test_hps_hub_path_and_v21(weights, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(
        huggingface_hub,
        "hf_hub_download",
        lambda repo, name: calls.append((repo, name)) or str(weights / "HPS_v2_compressed.pt"),
    )
    HPSv2(model_name=TINY_OPENCLIP)
    v21 = HPSv21(model_name=TINY_OPENCLIP)
    HPSv21(checkpoint="someone/HPS-mirror", model_name=TINY_OPENCLIP)
    assert calls == [
        ("xswu/HPSv2", "HPS_v2_compressed.pt"),
        ("xswu/HPSv2", "HPS_v2.1_compressed.pt"),
        ("someone/HPS-mirror", "HPS_v2.1_compressed.pt"),
    ]
    assert set(v21(images(2), PROMPTS[:2], {})) == {"hpsv21"}
    HPSv2(checkpoint=str(weights), model_name=TINY_OPENCLIP)  # a directory holding the file


def test_hps_missing_weights_name_the_file_and_the_command(tmp_path, monkeypatch):
    import huggingface_hub

    missing = tmp_path / "HPS_v2.1_compressed.pt"
    with pytest.raises(MissingRewardWeightsError, match=re.escape(str(missing))) as err:
        HPSv21(checkpoint=str(missing), model_name=TINY_OPENCLIP)
    assert isinstance(err.value, FileNotFoundError)
    assert "hf download xswu/HPSv2 HPS_v2.1_compressed.pt" in str(err.value)

    with pytest.raises(MissingRewardWeightsError, match="no file at 'ckpt/HPS_v2.pt'"):
        HPSv2(checkpoint="ckpt/HPS_v2.pt", model_name=TINY_OPENCLIP)  # relative path, not a hub id

    def offline(repo, name):
        raise OSError("no internet")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(MissingRewardWeightsError, match="hf download xswu/HPSv2 HPS_v2_compressed.pt"):
        HPSv2(model_name=TINY_OPENCLIP)


def test_hps_accepts_ddp_prefixed_state_dict_and_bf16(weights, tmp_path, models):
    sd = torch.load(weights / "HPS_v2_compressed.pt", map_location="cpu", weights_only=True)["state_dict"]
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}}, tmp_path / "ddp.pt")
    reward = HPSv2(checkpoint=str(tmp_path / "ddp.pt"), model_name=TINY_OPENCLIP)
    x = images(2)
    ref = models["hpsv2"](x, PROMPTS[:2], {})["hpsv2"]
    torch.testing.assert_close(reward(x, PROMPTS[:2], {})["hpsv2"], ref)
    assert reward.to("cpu", torch.bfloat16) is reward
    assert next(reward.model.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(reward(x, PROMPTS[:2], {})["hpsv2"], ref, atol=0.05, rtol=0)


def test_hps_rejects_wrong_file_format(tmp_path):
    torch.save({"model": {}}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="expected a dict with 'state_dict'"):
        HPSv2(checkpoint=str(tmp_path / "bad.pt"), model_name=TINY_OPENCLIP)


# ----------------------------------------------------------------------------- PickScore / CLIPScore


def reference_clip_features(weights, x, prompts, reward):
    """Features through the model's own public API, loaded separately from the reward."""
    from transformers import AutoTokenizer

    model = CLIPModel.from_pretrained(weights / "clip").eval()
    tokenizer = AutoTokenizer.from_pretrained(weights / "clip")
    tokens = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    with torch.no_grad():
        img = model.get_image_features(pixel_values=reward.preprocess(x))
        txt = model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
    as_tensor = lambda out: getattr(out, "pooler_output", out)  # noqa: E731 (a ModelOutput in transformers 5)
    return model, as_tensor(img), as_tensor(txt)


def test_pickscore_is_logit_scale_exp_times_cosine(models, weights):
    reward, x = models["pickscore"], images(3)
    model, img, txt = reference_clip_features(weights, x, PROMPTS[:3], reward)
    cos = F.cosine_similarity(img, txt)
    out = reward(x, PROMPTS[:3], {})
    torch.testing.assert_close(out["pickscore_cosine"], cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["pickscore"], model.logit_scale.exp() * cos, atol=1e-4, rtol=0)
    assert model.logit_scale.exp().item() == pytest.approx(torch.tensor(3.0).exp().item())


def test_pickscore_on_pil_agrees_with_the_processor_pipeline(models, weights):
    """The official pipeline (CLIPImageProcessor on PIL) gives the same score up to uint8 rounding."""
    from transformers import CLIPImageProcessor

    reward = models["pickscore"]
    pil = [smooth_pil(300, 200, 1), smooth_pil(120, 90, 2)]
    model = CLIPModel.from_pretrained(weights / "clip").eval()
    pixels = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})(
        images=pil, return_tensors="pt"
    )["pixel_values"]
    tokens = reward.tokenizer(
        PROMPTS[:2], padding="max_length", max_length=77, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model(
            input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels
        )
    official = torch.diagonal(out.logits_per_image)  # logit_scale.exp() * cosine, as PickScore's README
    torch.testing.assert_close(reward(pil, PROMPTS[:2], {})["pickscore"], official, atol=5e-3, rtol=0)


def test_pickscore_tokenizer_defaults_to_laion_when_dir_has_none(weights):
    with pytest.raises(MissingRewardWeightsError, match="laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
        PickScore(pretrained=str(weights / "clip_no_tokenizer"))
    reward = PickScore(pretrained=str(weights / "clip_no_tokenizer"), tokenizer=str(weights / "clip"))
    assert reward(images(1), PROMPTS[:1], {})["pickscore"].shape == (1,)


def test_clipscore_is_clamped_scaled_cosine(models, weights):
    reward, x = models["clipscore"], images(4)
    _, img, txt = reference_clip_features(weights, x, PROMPTS, reward)
    cos = F.cosine_similarity(img, txt)
    out = reward(x, PROMPTS, {})
    torch.testing.assert_close(out["clipscore_cosine"], cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["clipscore"], 100 * cos.clamp(min=0), atol=1e-3, rtol=0)


@pytest.mark.parametrize("cls", [PickScore, CLIPScore])
def test_missing_clip_directory_is_one_clear_error(cls, tmp_path):
    with pytest.raises(MissingRewardWeightsError, match=re.escape(str(tmp_path / "nope"))):
        cls(pretrained=str(tmp_path / "nope"))


# ----------------------------------------------------------------------------- aesthetic


def test_aesthetic_head_file_has_the_official_keys(weights):
    state = torch.load(weights / "head.pth", map_location="cpu", weights_only=True)
    assert list(state) == [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")]
    assert state["layers.0.weight"].shape == (1024, 16) and state["layers.7.weight"].shape == (1, 16)


def test_aesthetic_loads_head_with_map_location_cpu(weights, monkeypatch):
    seen, real_load = [], torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(aesthetic_mod.torch, "load", spy)
    LaionAesthetic(pretrained=str(weights / "clip"), head=str(weights / "head.pth"))
    assert seen == ["cpu"]


def test_aesthetic_is_the_linear_head_on_normalised_embeddings(models, weights):
    reward, x = models["aesthetic"], images(3)
    _, img, _ = reference_clip_features(weights, x, PROMPTS[:3], reward)
    h = F.normalize(img, dim=-1)
    state = torch.load(weights / "head.pth", map_location="cpu", weights_only=True)
    for i in (0, 2, 4, 6, 7):  # Dropouts at 1, 3, 5 are inactive at inference; no activations
        h = h @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    out = reward(x, None, {})
    assert set(out) == {"aesthetic"}
    torch.testing.assert_close(out["aesthetic"], h.squeeze(-1), atol=1e-5, rtol=0)


def test_aesthetic_head_sources(weights, tmp_path, monkeypatch):
    import huggingface_hub

    with pytest.raises(MissingRewardWeightsError, match="sac\\+logos\\+ava1-l14-linearMSE.pth"):
        LaionAesthetic(
            pretrained=str(weights / "clip"), head=str(tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
        )
    calls = []
    monkeypatch.setattr(
        huggingface_hub,
        "hf_hub_download",
        lambda repo, name: calls.append((repo, name)) or str(weights / "head.pth"),
    )
    LaionAesthetic(
        pretrained=str(weights / "clip"), head="hf://trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth"
    )
    assert calls == [("trl-lib/ddpo-aesthetic-predictor", "aesthetic-model.pth")]


def test_hps_random_checkpoint_builds_the_architecture_without_a_file(weights, capsys):
    """checkpoint='random' (throughput benchmarks at full size with no weights): the same
    architecture as the real checkpoint, finite scores, and a line saying they mean nothing."""
    from rewards.hps import HPSv21

    reward = HPSv21(checkpoint="random", model_name=TINY_OPENCLIP)
    assert "random weights" in capsys.readouterr().out
    real = HPSv2(checkpoint=str(weights / "HPS_v2_compressed.pt"), model_name=TINY_OPENCLIP)
    assert [(n, p.shape) for n, p in reward.model.named_parameters()] == [
        (n, p.shape) for n, p in real.model.named_parameters()
    ]
    scores = reward(images(), ["a cat"] * 4, {})["hpsv21"]
    assert scores.shape == (4,) and torch.isfinite(scores).all()
