"""ImageReward loader (Xu et al. 2023) on a tiny random BLIP, offline.

Each test model is saved as ``ImageReward.pt`` in the official layout (a plain state dict of the
ImageReward module: blip.visual_encoder.*, blip.text_encoder.*, mlp.layers.*, plus the unused
blip.vision_proj / blip.text_proj and the position_ids buffer) next to a BLIP-style
``med_config.json`` and a local BERT vocab, then loaded through the real loader.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from rewards.blip import TextConfig, ViTConfig
from rewards.imagereward import (
    ImageReward,
    ImageRewardCheckpointError,
    ImageRewardFilesMissing,
    ImageRewardNet,
    preprocess,
)
from rewards.images import RewardInputError

WORDS = ["a", "red", "cat", "on", "the", "mat", "blue", "dog", "painting", "of", "sky"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
VISION = {"image_size": 32, "patch_size": 8, "width": 48, "depth": 2, "heads": 4}
# BLIP's med_config.json with BERT-base swapped for a tiny BERT; encoder_width 768 is what the shipped
# file says, and the loader must override it with the vision width (48) as BLIP_Pretrain does.
MED = {
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 64,
    "model_type": "bert",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": len(VOCAB) + 2,
    "encoder_width": 768,
    "add_cross_attention": True,
}
PROMPTS = ["a red cat on the mat", "a painting of a blue dog", "the sky"]


def _perturb(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (LayerNorms near 1) so no parameter is inert in the comparisons."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=g)
            p.copy_(1 + noise if "norm" in name.lower() and name.endswith("weight") else noise)


def _official_extras(vision_width: int, text_width: int) -> dict[str, torch.Tensor]:
    """Keys ImageReward.pt carries that scoring does not use (BLIP_Pretrain ITC heads, med.py buffer)."""
    return {
        "blip.vision_proj.weight": torch.randn(256, vision_width),
        "blip.vision_proj.bias": torch.zeros(256),
        "blip.text_proj.weight": torch.randn(256, text_width),
        "blip.text_proj.bias": torch.zeros(256),
        "blip.text_encoder.embeddings.position_ids": torch.arange(MED["max_position_embeddings"])[None],
    }


def _official_state_dict(net: ImageRewardNet) -> dict[str, torch.Tensor]:
    sd = {(k if k.startswith("mlp.") else "blip." + k): v.clone() for k, v in net.state_dict().items()}
    return {**sd, **_official_extras(VISION["width"], MED["hidden_size"])}


def _write_files(root, state: dict, med: dict = MED):
    root.mkdir(parents=True, exist_ok=True)
    torch.save(state, root / "ImageReward.pt")
    (root / "med_config.json").write_text(json.dumps(med))
    tok = root / "tokenizer"
    tok.mkdir(exist_ok=True)
    (tok / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return root / "ImageReward.pt", tok


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    torch.manual_seed(0)
    net = ImageRewardNet(ViTConfig(**VISION), TextConfig.from_med_config(MED, encoder_width=VISION["width"]))
    _perturb(net, seed=1)
    state = _official_state_dict(net)
    ckpt, tok = _write_files(tmp_path_factory.mktemp("imagereward"), state)
    return ckpt, tok, state


@pytest.fixture(scope="module")
def reward(files):
    ckpt, tok, _ = files
    return ImageReward(
        checkpoint=str(ckpt), tokenizer=str(tok), device="cpu", batch_size=3, vision_config=VISION
    )


def _images(n=3, h=40, w=56, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def test_official_key_layout_is_what_the_loader_reads(files):
    _, _, state = files
    # names as they appear in THUDM's ImageReward.pt (timm ViT + med.py BERT + MLP head)
    for key in [
        "blip.visual_encoder.patch_embed.proj.weight",
        "blip.visual_encoder.cls_token",
        "blip.visual_encoder.pos_embed",
        "blip.visual_encoder.blocks.1.attn.qkv.weight",
        "blip.visual_encoder.blocks.0.mlp.fc2.bias",
        "blip.visual_encoder.norm.weight",
        "blip.text_encoder.embeddings.word_embeddings.weight",
        "blip.text_encoder.encoder.layer.1.attention.self.query.weight",
        "blip.text_encoder.encoder.layer.0.crossattention.self.key.weight",
        "blip.text_encoder.encoder.layer.0.crossattention.output.LayerNorm.bias",
        "blip.text_encoder.encoder.layer.1.output.dense.weight",
        "mlp.layers.0.weight",
        "mlp.layers.7.bias",
    ]:
        assert key in state, key
    # cross-attention keys read the ViT width, not med_config's encoder_width
    assert state["blip.text_encoder.encoder.layer.0.crossattention.self.key.weight"].shape == (32, 48)
    assert not any(k.startswith("blip.text_encoder.embeddings.token_type") for k in state)


def test_scores_shape_finite_and_normalisation_by_hand(reward):
    raw = []
    hook = reward.net.mlp.register_forward_hook(lambda m, i, o: raw.append(o.detach().squeeze(-1)))
    try:
        out = reward(_images(), PROMPTS, {})
    finally:
        hook.remove()
    score = out["imagereward"]
    assert list(out) == ["imagereward"] and score.shape == (3,) and torch.isfinite(score).all()
    expected = (torch.cat(raw) - 0.16717362830052426) / 1.0333394966054072
    torch.testing.assert_close(score, expected, rtol=0, atol=1e-6)
    assert score.std() > 0  # the prompts and images actually move the score


def test_text_input_is_cls_first_padded_to_35(reward):
    seen = {}
    hook = reward.net.text_encoder.register_forward_pre_hook(
        lambda m, args: seen.update(ids=args[0], mask=args[1])
    )
    try:
        reward(_images(), PROMPTS)
    finally:
        hook.remove()
    ids, mask = seen["ids"], seen["mask"]
    tok = reward.tokenizer
    assert ids.shape == (3, 35) and mask.shape == (3, 35)
    # ImageReward.score feeds the tokenizer's ids unchanged: position 0 is [CLS], not BLIP's [ENC]
    assert (ids[:, 0] == tok.cls_token_id).all() and (ids[:, 0] != reward.enc_token_id).all()
    assert ids[0, :8].tolist() == [2, 5, 6, 7, 8, 9, 10, 3]  # [CLS] a red cat on the mat [SEP]
    assert (ids[mask == 0] == tok.pad_token_id).all()
    # BLIP's init_tokenizer adds [DEC] (bos) then [ENC] after the BERT vocab
    assert tok.convert_tokens_to_ids("[DEC]") == len(VOCAB) and reward.enc_token_id == len(VOCAB) + 1


def test_batch_size_invariance(files, reward):
    ckpt, tok, _ = files
    images = _images()
    one = ImageReward(checkpoint=ckpt, tokenizer=tok, device="cpu", batch_size=1, vision_config=VISION)
    batched = reward(images, PROMPTS)["imagereward"]
    torch.testing.assert_close(one(images, PROMPTS)["imagereward"], batched, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        reward(images[1:2], PROMPTS[1:2])["imagereward"], batched[1:2], rtol=0, atol=1e-5
    )


def test_gradients_reach_the_images(reward):
    images = _images().requires_grad_(True)
    reward(images, PROMPTS)["imagereward"].sum().backward()
    assert images.grad is not None and torch.isfinite(images.grad).all() and images.grad.abs().sum() > 0
    assert all(p.grad is None for p in reward.net.parameters())  # the reward model stays frozen


def test_pil_list_and_video_inputs(reward):
    arrays = (np.random.default_rng(0).random((2, 40, 56, 3)) * 255).astype(np.uint8)
    pil = reward([Image.fromarray(a) for a in arrays], PROMPTS[:2])["imagereward"]
    tensor = torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(pil, reward(tensor, PROMPTS[:2])["imagereward"], rtol=0, atol=1e-6)
    video = torch.stack([_images(seed=1), _images(seed=2)], dim=1)  # (B=3, F=2, 3, H, W)
    frames = [reward(video[:, f], PROMPTS)["imagereward"] for f in range(2)]
    torch.testing.assert_close(
        reward(video, PROMPTS)["imagereward"], (frames[0] + frames[1]) / 2, atol=1e-6, rtol=0
    )


def test_bfloat16_runs_close_to_float32(files, reward):
    ckpt, tok, _ = files
    bf16 = ImageReward(checkpoint=ckpt, tokenizer=tok, device="cpu", dtype="bfloat16", vision_config=VISION)
    score = bf16(_images(), PROMPTS)["imagereward"]
    assert score.dtype == torch.float32
    torch.testing.assert_close(score, reward(_images(), PROMPTS)["imagereward"], rtol=0, atol=0.15)


def test_bad_inputs(reward):
    with pytest.raises(RewardInputError, match="3 channels"):
        reward(torch.rand(2, 4, 32, 32), PROMPTS[:2])
    with pytest.raises(RewardInputError):
        reward(torch.rand(3, 32, 32), PROMPTS[:1])
    with pytest.raises(RewardInputError, match=r"\[0, 1\]"):
        reward(torch.rand(2, 3, 32, 32) * 2 - 1 - 0.6, PROMPTS[:2])
    with pytest.raises(ValueError, match="one prompt string per image"):
        reward(torch.rand(2, 3, 32, 32), PROMPTS)


def test_missing_files_give_one_clear_error(tmp_path, files):
    _, tok, state = files
    with pytest.raises(
        ImageRewardFilesMissing, match="hf download THUDM/ImageReward ImageReward.pt med_config.json"
    ) as err:
        ImageReward(
            checkpoint=tmp_path / "nowhere" / "ImageReward.pt",
            tokenizer=tok,
            device="cpu",
            vision_config=VISION,
        )
    assert isinstance(err.value, FileNotFoundError) and "ImageReward.pt" in str(err.value)
    ckpt, _ = _write_files(tmp_path / "no_cfg", state)
    (ckpt.parent / "med_config.json").unlink()
    with pytest.raises(ImageRewardFilesMissing, match="med_config.json"):
        ImageReward(checkpoint=ckpt, tokenizer=tok, device="cpu", vision_config=VISION)
    with pytest.raises(ImageRewardFilesMissing, match="bert-base-uncased"):
        ImageReward(
            checkpoint=files[0], tokenizer=tmp_path / "no_tokenizer", device="cpu", vision_config=VISION
        )


def test_strict_load_names_missing_and_unexpected_keys(tmp_path, files):
    _, tok, state = files
    gone = "blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"
    ckpt, _ = _write_files(tmp_path / "missing", {k: v for k, v in state.items() if k != gone})
    with pytest.raises(ImageRewardCheckpointError, match="1 missing keys.*" + gone.replace(".", r"\.")):
        ImageReward(checkpoint=ckpt, tokenizer=tok, device="cpu", vision_config=VISION)
    ckpt, _ = _write_files(tmp_path / "extra", {**state, "blip.itm_head.weight": torch.zeros(2, 32)})
    with pytest.raises(ImageRewardCheckpointError, match="unexpected keys.*blip.itm_head.weight"):
        ImageReward(checkpoint=ckpt, tokenizer=tok, device="cpu", vision_config=VISION)
    # a vision_config that is not the checkpoint's fails on shapes, with the file named
    with pytest.raises(ImageRewardCheckpointError, match="size mismatch"):
        ImageReward(
            checkpoint=files[0], tokenizer=tok, device="cpu", vision_config={**VISION, "patch_size": 16}
        )


def test_preprocess_matches_torchvision_and_hand_normalisation():
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    for h, w in [(40, 56), (57, 33), (64, 64), (20, 30)]:
        x = _images(2, h, w, seed=h)
        ref = TF.resize(x, 32, interpolation=InterpolationMode.BICUBIC, antialias=True).clamp(0, 1)
        ref = TF.normalize(TF.center_crop(ref, 32), mean, std)
        torch.testing.assert_close(preprocess(x, 32), ref, rtol=0, atol=1e-6)
    x = _images(1, 32, 32)  # already at size: normalisation only, computed by hand
    by_hand = torch.stack([(x[:, c] - mean[c]) / std[c] for c in range(3)], dim=1)
    torch.testing.assert_close(preprocess(x, 32), by_hand, rtol=0, atol=1e-6)


def test_preprocess_is_close_to_the_official_pil_pipeline():
    """The reference resizes uint8 PIL images; the tensor path differs by about the uint8 rounding."""
    from torchvision import transforms as T

    official = T.Compose(
        [
            T.Resize(224, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(224),
            T.ToTensor(),
            T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ]
    )
    rng = np.random.default_rng(0)
    smooth = torch.nn.functional.interpolate(
        torch.from_numpy(rng.random((1, 3, 12, 16))).float(), size=(384, 512), mode="bilinear"
    )
    array = (smooth[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    ref = official(Image.fromarray(array))
    ours = preprocess(torch.from_numpy(array).permute(2, 0, 1)[None].float() / 255, 224)[0]
    assert (ours - ref).abs().max() < 3 / 255 / 0.26  # a couple of uint8 steps after normalisation


def _blip_reward_head(width: int) -> torch.nn.Sequential:
    """ImageReward's MLP (ImageReward.py, ``MLP``), with its dropouts, so the state-dict
    indices (layers.0, 2, 4, 6, 7) are the official ones."""
    return torch.nn.Sequential(
        torch.nn.Linear(width, 1024),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(1024, 128),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 64),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, 16),
        torch.nn.Linear(16, 1),
    ).eval()


def test_matches_timm_vit_and_transformers_blip_text_reference(tmp_path):
    """Independent reference: timm's ViT and transformers' BlipTextModel (both ports of BLIP's
    vit.py / med.py) with random weights, exported under the official names."""
    timm = pytest.importorskip("timm")
    from transformers import BlipTextConfig
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    torch.manual_seed(0)
    vit = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=0, global_pool=""
    ).eval()
    # is_decoder=True only makes BlipTextModel build the cross-attention;
    # forward(is_decoder=False) is bidirectional
    text = BlipTextModel(
        BlipTextConfig(
            vocab_size=MED["vocab_size"],
            hidden_size=32,
            encoder_hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            is_decoder=True,
        ),
        add_pooling_layer=False,
    ).eval()
    mlp = _blip_reward_head(32)
    for i, m in enumerate((vit, text, mlp)):
        _perturb(m, seed=10 + i)
    state = {
        **{"blip.visual_encoder." + k: v for k, v in vit.state_dict().items()},
        **{"blip.text_encoder." + k: v for k, v in text.state_dict().items()},
        **{"mlp.layers." + k: v for k, v in mlp.state_dict().items()},
        **_official_extras(48, 32),
    }
    ckpt, tok = _write_files(tmp_path, state)
    reward = ImageReward(checkpoint=ckpt, tokenizer=tok, device="cpu", batch_size=2, vision_config=VISION)

    images = _images(3, 48, 40, seed=5)
    ids, mask = reward.tokenize(PROMPTS)
    with torch.no_grad():
        image_tokens = vit.forward_features(preprocess(images, 32))
        hidden = text(
            input_ids=ids,
            attention_mask=mask,
            encoder_hidden_states=image_tokens,
            encoder_attention_mask=torch.ones(image_tokens.shape[:2], dtype=torch.long),
        ).last_hidden_state
        expected = (mlp(hidden[:, 0]).squeeze(-1) - 0.16717362830052426) / 1.0333394966054072
        got = reward(images, PROMPTS)["imagereward"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
