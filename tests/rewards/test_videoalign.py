"""The ``videoalign`` reward over a tiny random checkpoint written in the released format:
``model_config.json`` and ``checkpoint-N/model.pth``, the PEFT model's state dict in
transformers 4.45's key layout with LoRA unmerged, plus a tokenizer with the three reward
tokens. The second code path is the PEFT model itself (LoRA applied by peft's forward, not
merged) with the reference's head reading; frame sampling and resizing are checked against
hand-computed values of VideoAlign's formulas; the template is fetched from a loopback
server."""

import functools
import hashlib
import http.server
import json
import threading

import pytest
import torch

import rewards
from diffrl.models import tiny
from diffrl.models.qwenimage_edit import QWEN_VL_IMAGE_PROCESSOR
from rewards.videoalign import (
    SPECIAL_TOKENS,
    VideoAlignError,
    VideoAlignReward,
    resized_size,
    sampled_frame_count,
    sampled_frames,
    template_text,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for content in message['content'] %}{% if content['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a made-up template in the reference file's shape: the three tokens in the order VQ, MQ, TA
TEMPLATE = (
    "Rate the clip.\nLook: <|VQ_reward|>\nMove: <|MQ_reward|>\nPrompt - {text_prompt}\nMatch: <|TA_reward|>\n"
)
TEMPLATE_FILE = f'OTHER = "x"\n\nDETAILED_PROMPT_WITH_SPECIAL_TOKEN = """{TEMPLATE}"""\n'
NORM = {"VQ_mean": 3.0, "VQ_std": 2.0, "MQ_mean": 1.0, "MQ_std": 1.5, "TA_mean": 2.5, "TA_std": 2.5}
LORA = {"lora_enable": True, "lora_r": 4, "lora_alpha": 8}


def _config(tok, vocab):
    from transformers import Qwen2VLConfig

    ids = tok.convert_tokens_to_ids
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        ),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def _old_layout(key: str) -> str:
    """Today's Qwen2-VL names -> transformers 4.45's, as the released model.pth has them."""
    prefix = "base_model.model."
    inner = key.removeprefix(prefix)
    if inner.startswith("model.visual."):
        inner = inner.removeprefix("model.")
    elif inner.startswith("model.language_model."):
        inner = "model." + inner.removeprefix("model.language_model.")
    return prefix + inner


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(checkpoint dir, template file, the PEFT model and head: the second code path)."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    root = tmp_path_factory.mktemp("videoalign")
    base, ckpt = root / "base", root / "ckpt"
    tok = tiny.qwen2_tokenizer(extra_words=("Rate", "clip", "Look", "Move", "Match", "Prompt"))
    Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**QWEN_VL_IMAGE_PROCESSOR),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(base)
    _config(tok, len(tok)).save_pretrained(base)  # the base's config: its weights are not needed
    tok.add_tokens(list(SPECIAL_TOKENS), special_tokens=True)
    with tiny.seeded(0):
        model = Qwen2VLForConditionalGeneration(_config(tok, len(tok)))
        model.rm_head = torch.nn.Linear(32, 1, bias=False)
    targets = [
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "language_model" in n
    ]
    peft = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")
    )
    with torch.no_grad(), tiny.seeded(1):
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    step = ckpt / "checkpoint-12"
    (step / "tokenizer").mkdir(parents=True)
    tok.save_pretrained(step / "tokenizer")
    torch.save({_old_layout(k): v for k, v in peft.state_dict().items()}, step / "model.pth")
    (ckpt / "checkpoint-3").mkdir()  # an older step: the newest is used
    config = {
        "model_config": {"model_name_or_path": str(base), "output_dim": 1, "use_special_tokens": True,
                         "reward_token": "special"},
        "data_config": {"fps": 2.0, "max_frame_pixels": 200704, "sample_type": "uniform",
                        "prompt_template_type": "detailed_special"},
        "peft_lora_config": LORA,
        "inference_config": NORM,
    }  # fmt: skip
    (ckpt / "model_config.json").write_text(json.dumps(config))
    template = root / "prompt_template.py"
    template.write_text(TEMPLATE_FILE)
    return ckpt, template, peft.eval()


@pytest.fixture(scope="module")
def reward(release):
    ckpt, template, _ = release
    return VideoAlignReward(checkpoint=str(ckpt), template=str(template), dtype="float32", video_fps=8.0)


def clips(n=2, frames=9, seed=0):
    return torch.rand(n, frames, 3, 32, 40, generator=torch.Generator().manual_seed(seed))


def _peft_scores(peft, reward, video, prompts, m_rope=False):
    """The head read as Qwen2VLRewardModelBT.forward reads it (VideoAlign trainer.py:96-129),
    through the PEFT model: the token embeddings, the vision tower's merged features
    scattered over the video tokens, then the text model with ``position_ids=None`` (its
    own 1-D positions, as transformers 4.45's model makes them). ``m_rope``: instead let
    today's Qwen2VLModel place the video tokens on their 3-D M-RoPE grid (the old error)."""
    batch = reward.inputs(video, prompts)
    ids = batch["input_ids"]
    vl = peft.base_model.model.model  # Qwen2VLModel: .visual, .language_model
    with torch.no_grad():
        if m_rope:
            inputs = {k: v for k, v in batch.items() if k != "pixel_values_videos"}
            hidden = vl(**inputs, pixel_values_videos=batch["pixel_values_videos"]).last_hidden_state
        else:
            embeds = vl.language_model.embed_tokens(ids)
            features = vl.visual(batch["pixel_values_videos"], grid_thw=batch["video_grid_thw"]).pooler_output
            video_tokens = (ids == vl.config.video_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(video_tokens, features.to(embeds.dtype))
            hidden = vl.language_model(
                inputs_embeds=embeds, attention_mask=batch["attention_mask"], position_ids=None
            ).last_hidden_state
        logits = peft.base_model.model.rm_head(hidden)
    tokens = reward.processor.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for t in tokens:
        mask |= ids == t
    return logits[mask].view(len(prompts), 3, -1).reshape(len(prompts), 3)


def test_scores_equal_the_peft_model_s(release, reward):
    _, _, peft = release
    video = clips()
    prompts = ["a red ball rolls left", "two cats"]
    expected = _peft_scores(peft, reward, video, prompts)
    out = reward(video, prompts)
    mean = torch.tensor([NORM["VQ_mean"], NORM["MQ_mean"], NORM["TA_mean"]])
    std = torch.tensor([NORM["VQ_std"], NORM["MQ_std"], NORM["TA_std"]])
    normed = (expected - mean) / std
    got = torch.stack([out["videoalign_vq"], out["videoalign_mq"], out["videoalign_ta"]], 1)
    torch.testing.assert_close(got, normed, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["videoalign"], normed.sum(1), rtol=1e-4, atol=1e-5)  # overall
    assert expected.std() > 1e-3  # the random head reads something that varies
    # the positions matter: on the 3-D M-RoPE grid today's model builds, the scores move
    m_rope = _peft_scores(peft, reward, video, prompts, m_rope=True)
    assert (m_rope - expected).abs().max() > 1e-3


def test_lora_matters_and_batching_does_not(release, reward):
    """The merged LoRA changes the scores (a checkpoint read without it would differ), and
    scoring one clip at a time (no right padding) gives the batch's scores."""
    _, _, peft = release
    video, prompts = clips(), ["a red ball rolls left", "two cats on a very long mat"]
    with peft.disable_adapter():
        without = _peft_scores(peft, reward, video, prompts)
    raw = reward.raw_scores(video, prompts)
    assert (raw - without).abs().max() > 1e-3
    one_by_one = torch.cat([reward.raw_scores(video[i : i + 1], prompts[i : i + 1]) for i in range(2)])
    torch.testing.assert_close(one_by_one, raw, rtol=1e-4, atol=1e-5)


def test_score_choice_and_no_norm(release):
    ckpt, template, _ = release
    vq = VideoAlignReward(
        checkpoint=str(ckpt), template=str(template), score="VQ", use_norm=False, dtype="float32"
    )
    out = vq(clips(1), ["a cat"])
    raw = vq.raw_scores(clips(1), ["a cat"])
    assert torch.equal(out["videoalign"], out["videoalign_vq"]) and torch.allclose(
        out["videoalign_vq"], raw[:, 0]
    )
    assert "videoalign" in rewards.available()


def test_frame_sampling_and_resizing_by_hand():
    # 81 frames at 16 fps sampled at 2 fps: 81 / 16 * 2 = 10.1 -> 10 frames, indices rounded
    assert sampled_frame_count(81, 16.0, 2.0) == 10
    assert sampled_frames(81, 16.0, 2.0) == [0, 9, 18, 27, 36, 44, 53, 62, 71, 80]
    # a 9-frame clip at 8 fps: 2.25 frames, raised to the minimum of 4
    assert sampled_frames(9, 8.0, 2.0) == [0, 3, 5, 8]
    # 3 frames: the minimum 4 is more than the clip holds; the multiple of 2 below it is 2
    assert sampled_frame_count(3, 8.0, 2.0) == 2
    with pytest.raises(VideoAlignError, match="too short"):
        sampled_frame_count(1, 8.0, 2.0)
    # 480 x 832 (Wan) into 200704 pixels: beta = sqrt(399360 / 200704) = 1.4106, floors 336 x 588
    assert resized_size(480, 832, 128 * 28 * 28, 200704) == (336, 588)
    # 32 x 40 up to at least 100352 pixels: beta = sqrt(100352 / 1280) = 8.854, ceilings 308 x 364
    assert resized_size(32, 40, 128 * 28 * 28, 200704) == (308, 364)


def test_the_prompt_is_the_template_with_the_text(reward):
    text = reward.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": reward.prompt("a dog")}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "Prompt - a dog\nMatch: <|TA_reward|>" in text and text.index("<|video_pad|>") < text.index("Rate")


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_template_from_a_url_pinned_by_sha256(release, tmp_path, monkeypatch):
    _, template, _ = release
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    handler = functools.partial(_Handler, directory=str(template.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{template.name}"
        sha = hashlib.sha256(template.read_bytes()).hexdigest()
        assert template_text(url, sha256=sha) == TEMPLATE
        assert (
            len(list((tmp_path / "hub" / "checkpoints").glob("videoalign-*.py"))) == 1
        )  # kept: fetched once
        with pytest.raises(VideoAlignError, match="not the pinned prompt_template.py"):
            template_text(url, sha256="0" * 64)
    finally:
        server.shutdown()
    with pytest.raises(VideoAlignError, match="could not fetch"):
        template_text("http://127.0.0.1:9/prompt_template.py")
    bad = tmp_path / "t.py"
    bad.write_text("X = 1\n")
    with pytest.raises(VideoAlignError, match="defines no string DETAILED_PROMPT_WITH_SPECIAL_TOKEN"):
        template_text(str(bad))


def test_missing_checkpoint_names_the_download(tmp_path):
    with pytest.raises(VideoAlignError, match="hf download KwaiVGI/VideoReward"):
        VideoAlignReward(checkpoint=str(tmp_path), template=str(tmp_path / "t.py"))
    (tmp_path / "model_config.json").write_text(json.dumps({"model_config": {"model_name_or_path": "x"}}))
    with pytest.raises(VideoAlignError, match="no checkpoint-N/model.pth"):
        VideoAlignReward(checkpoint=str(tmp_path), template=str(tmp_path / "t.py"))
