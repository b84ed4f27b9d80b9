"""Qwen-Image-Edit (``QwenImageEditPipeline``) on its tiny twin, offline on CPU: prompts
carry input images, the image enters both the Qwen2.5-VL conditioning (vision tokens) and
the image tokens (appended latents), and the velocity is one step of diffusers' own
pipeline run from the instruction text and the image."""

from __future__ import annotations

import os

import pytest
import torch
from PIL import Image

from diffrl.data.prompts import PromptFileError
from diffrl.models import adapter_class, build_adapter
from rewards.prompts import EditPrompt
from tests.models.lora import add_random_lora, lora_state
from tests.models.test_adapters import make_cfg, noise

FAMILY = "qwenimage_edit"


def make(**overrides):
    return build_adapter(make_cfg(FAMILY, **overrides))


@pytest.fixture(scope="module")
def twin():
    """One CFG twin (true CFG 4) for the tests that only read it."""
    return make()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sources")
    paths = []
    for i, colour in enumerate([(220, 30, 30), (30, 60, 220)]):
        im = Image.new("RGB", (32, 32), (255, 255, 255))
        im.paste(colour, (4 + 8 * i, 6, 20 + 8 * i, 22))
        im.save(directory / f"{i}.png")
        paths.append(directory / f"{i}.png")
    return paths


def _pipeline_first_step(adapter, prompts, x, monkeypatch):
    """The real pipeline from ``x``, given the instructions as text and the input images as
    PIL images at the run size, stopped after its first step (its one-step schedule is NaN:
    tests/models/test_qwenimage.py). Returns (latents after the step, the scheduler's sigmas).

    The pipeline resizes its input to about 1024^2 pixels with no argument to turn that off
    (``calculate_dimensions(1024 * 1024, ratio)``); patching that function to the run size
    makes its resize of an image already at that size a no-op (PIL returns a copy), which
    is the adapter's documented deviation."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    size = (adapter.cfg.width, adapter.cfg.height)
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: (*size, None))

    def stop_after_first(pipe, i, t, kwargs):
        pipe._interrupt = True
        return {}

    out = adapter.pipe(
        image=[Image.open(p.image).convert("RGB") for p in prompts],
        prompt=[str(p) for p in prompts],
        negative_prompt=[" "] * len(prompts),
        true_cfg_scale=adapter.cfg.guidance_scale,
        height=size[1],
        width=size[0],
        num_inference_steps=2,
        latents=x,
        output_type="latent",
        callback_on_step_end=stop_after_first,
    ).images
    return out, adapter.pipe.scheduler.sigmas.clone()


# ----------------------------------------------------------------------------- construction


def test_tiny_twin_is_an_edit_pipeline_on_the_real_classes(twin):
    import diffusers
    import transformers

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    rng_before = torch.get_rng_state()
    make()
    assert torch.equal(torch.get_rng_state(), rng_before), "tiny init must not consume the global RNG"
    assert twin.edits_images and twin.family == FAMILY
    assert type(twin.pipe) is diffusers.QwenImageEditPipeline is adapter_class(FAMILY).pipeline_class
    expected = {
        "transformer": diffusers.QwenImageTransformer2DModel,
        "vae": diffusers.AutoencoderKLQwenImage,
        "text_encoder": transformers.Qwen2_5_VLForConditionalGeneration,
        "tokenizer": transformers.Qwen2TokenizerFast,
        "processor": transformers.Qwen2VLProcessor,
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler,
    }
    for name, cls in expected.items():
        assert isinstance(getattr(twin.pipe, name), cls), name
    assert isinstance(twin.pipe.processor.image_processor, transformers.Qwen2VLImageProcessor)
    # the processor's patches are the ones the tiny vision tower embeds and merges
    vision, processor = twin.pipe.text_encoder.config.vision_config, twin.pipe.processor.image_processor
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (
        processor.patch_size,
        processor.temporal_patch_size,
        processor.merge_size,
    )
    tok, config = twin.pipe.tokenizer, twin.pipe.text_encoder.config
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    # the text-to-image twin's transformer and VAE, weight for weight
    base = build_adapter(make_cfg("qwenimage"))
    for name in ("transformer", "vae"):
        other = getattr(base.pipe, name).state_dict()
        assert all(torch.equal(v, other[k]) for k, v in getattr(twin.pipe, name).state_dict().items()), name


def test_template_prefix_the_pipeline_drops_is_exactly_the_system_prompt(twin):
    """The pipeline drops the first ``prompt_template_encode_start_idx`` (64) hidden states:
    with the tiny vocabulary they must be the edit template's system prefix, so that the
    conditioning starts at <|vision_start|>, as with Qwen2's vocabulary."""
    from diffrl.data.prompts import PROJECT_ROOT, load_prompts

    pipe, tok = twin.pipe, twin.pipe.tokenizer
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    assert drop == 64
    prefix = template.split("<|vision_start|>")[0]
    ids = tok(template.format("make the red circle green")).input_ids
    assert tok.decode(ids[:drop]) == prefix
    assert ids[drop] == tok.convert_tokens_to_ids("<|vision_start|>")
    # every shipped ShapeWorld instruction and the 5 closing tokens fit the twin's budget
    edits = PROJECT_ROOT / "assets" / "shapeworld" / "edit"
    prompts = load_prompts(edits / "train.jsonl") + load_prompts(edits / "heldout.jsonl")
    assert max(len(tok(str(p)).input_ids) for p in prompts) + 5 <= twin.cfg.max_sequence_length


# ----------------------------------------------------------------------------- prompts


def test_prompts_need_images_and_each_image_is_its_own_conditioning(images):
    adapter = make()
    with pytest.raises(PromptFileError, match="no input image"):
        adapter.encode_prompts(["make the red square blue"])
    calls = []
    original = adapter._encode_uncached

    def counting(prompts):
        calls.append(list(prompts))
        return original(prompts)

    adapter._encode_uncached = counting
    a, b = (EditPrompt("make it blue", p) for p in images)
    cond = adapter.encode_prompts([a, b, a])
    assert calls == [[a, b]]
    assert set(cond.tensors) == {f"{neg}{key}" for neg in ("", "negative_") for key in adapter.cond_keys}
    latents = cond.tensors["image_latents"]
    assert latents.shape == (3, *adapter.latent_shape())  # same size as the target: one token each
    # 32 px -> 56 px (the processor's minimum) -> 4 x 4 patches -> 2 x 2 merged tokens
    assert adapter.vision_tokens() == 4
    length = adapter.text_length()
    assert length == 4 + 2 + adapter.cfg.max_sequence_length
    for key, value in cond.tensors.items():
        assert torch.equal(value[0], value[2]), key
        assert value.shape[1] == (length if "prompt" in key else latents.shape[1]), key
    # the VL encoder sees the image: the same instruction with another image, other embeddings
    for key in ("image_latents", "prompt_embeds", "negative_prompt_embeds"):
        assert not torch.allclose(cond.tensors[key][0], cond.tensors[key][1]), key
    # the valid part is the pipeline's own encode_prompt of the instruction with its image
    embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_embeds_mask"]
    ref, ref_mask = adapter.pipe.encode_prompt(["make it blue"], image=[adapter._vl_image(a.image)])
    n = ref.shape[1]
    assert ref_mask is None and int(mask[0].sum()) == n < length
    torch.testing.assert_close(embeds[0, :n], ref[0], atol=1e-6, rtol=0)
    assert (embeds[0, n:] == 0).all()


# ----------------------------------------------------------------------------- velocity


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0], ids=["cfg", "no_cfg"])
def test_velocity_matches_one_step_of_the_real_pipeline(guidance_scale, images, monkeypatch):
    """The pipeline encodes the instructions with their images itself (processor, vision
    tower, template, dropped prefix), VAE-encodes the images, appends them, runs true CFG
    with the norm rescale and cuts the output: its first Euler step is x + (s_1 - s_0) v."""
    adapter = make(guidance_scale=guidance_scale)
    prompts = [EditPrompt("make it blue", images[0]), EditPrompt("remove the red square", images[1])]
    cond = adapter.encode_prompts(prompts)
    x = noise(adapter, 2, seed=3)
    out, used = _pipeline_first_step(adapter, prompts, x, monkeypatch)
    v = adapter.velocity(adapter.transformer, x, torch.full((2,), float(used[0])), cond)
    torch.testing.assert_close(out.float(), x + (used[1] - used[0]) * v, atol=1e-5, rtol=1e-5)


def test_the_input_image_changes_the_velocity_and_batches_do_not(twin, images):
    a, b = (EditPrompt("make it blue", p) for p in images)
    x, sigma = noise(twin, 1).repeat(2, 1, 1), torch.tensor([0.7, 0.7])
    v = twin.velocity(twin.transformer, x, sigma, twin.encode_prompts([a, b]))
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert (v[0] - v[1]).abs().max() > 1e-4
    alone = twin.velocity(twin.transformer, x[:1], sigma[:1], twin.encode_prompts([a]))
    torch.testing.assert_close(v[:1], alone, atol=1e-5, rtol=1e-5)


def test_lora_round_trip_through_load_lora_weights(images, tmp_path):
    adapter = make()
    prompts = [EditPrompt("make it blue", p) for p in images]
    cond = adapter.encode_prompts(prompts)
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.4])
    base = adapter.velocity(adapter.transformer, x, sigma, cond)
    add_random_lora(adapter)
    tuned = adapter.velocity(adapter.transformer, x, sigma, cond)
    assert (tuned - base).abs().max() > 1e-3
    adapter.save_lora(tmp_path / "lora", lora_state(adapter))
    fresh = make()
    fresh.pipe.load_lora_weights(tmp_path / "lora")
    reloaded = fresh.velocity(fresh.transformer, x, sigma, fresh.encode_prompts(prompts))
    torch.testing.assert_close(reloaded, tuned, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- full size


def test_random_qwen_image_edit_builds_on_meta_at_the_published_size():
    """The published 20B transformer on meta; the VL conditioning (instruction and image) from
    the CPU encoder at the published width, with the real vision-token count; the input image
    through the full-size VAE on meta, as many tokens as the target's."""
    from diffrl.models.arch import load_arch
    from tests.helpers import family_prompts

    adapter = build_adapter(
        make_cfg(FAMILY, pretrained="random:qwen-image-edit", height=512, width=512), device="meta"
    )
    assert all(p.is_meta for p in adapter.transformer.parameters())
    assert sum(p.numel() for p in adapter.transformer.parameters()) == 20_430_401_088
    assert load_arch("qwen-image-edit").transformer == load_arch("qwen-image").transformer
    assert tuple(adapter.latent_shape()) == (1024, 64)  # 512 px: (512 / 16)^2 tokens of 2x2x16
    assert adapter.vision_tokens() == 324  # 512 -> 504 px: 36 x 36 patches, 18 x 18 merged
    cond = adapter.encode_prompts(family_prompts(FAMILY, ["make it blue", "remove it"]))
    text = (324 + 2 + adapter.cfg.max_sequence_length, 3584)
    for key in ("prompt_embeds", "negative_prompt_embeds"):
        assert tuple(cond.tensors[key].shape[1:]) == text and cond.tensors[key].is_meta, key
    image = cond.tensors["image_latents"]
    assert tuple(image.shape) == (2, 1024, 64) and image.is_meta
    x = torch.zeros((2, 1024, 64), device="meta")
    v = adapter.velocity(adapter.transformer, x, torch.full((2,), 0.5, device="meta"), cond)
    assert v.shape == x.shape and v.is_meta


def test_the_real_config_resolves_to_its_architecture():
    from diffrl.config import load_config
    from diffrl.models.arch import arch_for

    cfg = load_config("qwenimage_edit_flowgrpo")
    arch = arch_for(cfg.model.pretrained)
    assert (arch.name, arch.family, arch.hub_ids) == ("qwen-image-edit", FAMILY, ("Qwen/Qwen-Image-Edit",))
    assert cfg.model.family == FAMILY
    # the widened vision tower's merger feeds the published text width
    overrides = arch.text_overrides["text_encoder"]
    assert overrides["vision_config"]["out_hidden_size"] == overrides["text_config"]["hidden_size"] == 3584
