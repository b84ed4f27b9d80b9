"""Qwen-Image adapter (``QwenImagePipeline``) on its tiny twin, offline on CPU.

The checks every diffusers family passes (tests/models/test_adapters.py), plus what is
particular to Qwen-Image: the chat template's dropped system prefix lining up with the
tiny tokenizer, the per-token norm rescale of its true CFG, the exponential shift with
the stretch to ``shift_terminal`` (and the pipeline's NaN schedule at one step), and the
published 20B architecture on the meta device.
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import torch

from diffrl.models import adapter_class, build_adapter
from diffrl.models.arch import ARCH_DIR, load_arch
from diffrl.models.base import Conditioning, FlowAdapter
from diffrl.precision.keep_high import split_keep_high
from tests.models.lora import add_random_lora, lora_state
from tests.models.test_adapters import PROMPTS, make_cfg, noise

FAMILY = "qwenimage"


def make(**overrides):
    return build_adapter(make_cfg(FAMILY, **overrides))


@pytest.fixture(scope="module")
def twin():
    """One CFG twin (guidance 4) for the tests that only read it."""
    return make()


def _interrupt_after_first_step(captured: dict):
    """A ``callback_on_step_end`` that keeps the first step's latents and stops the loop there."""

    def callback(pipe, i, t, kwargs):
        captured.setdefault("latents", kwargs["latents"].clone())
        pipe._interrupt = True
        return {}

    return callback


def _pipeline_first_step(adapter, cond, x, num_steps=2, sigmas=None, output_type="latent", height=None):
    """Run the real pipeline from ``x`` on the adapter's cached embeddings and stop after its
    first step; return (output, the step's latents, the pipeline scheduler's sigmas).

    One step is not used because the pipeline's one-step schedule is NaN (see
    test_one_step_schedule_is_nan_in_the_pipeline_and_one_euler_step_here)."""
    t = cond.tensors
    kwargs = dict(prompt_embeds=t["prompt_embeds"], prompt_embeds_mask=t["prompt_embeds_mask"])
    if "negative_prompt_embeds" in t:
        kwargs.update(
            negative_prompt_embeds=t["negative_prompt_embeds"],
            negative_prompt_embeds_mask=t["negative_prompt_embeds_mask"],
        )
    captured: dict = {}
    size = height or adapter.cfg.height
    out = adapter.pipe(
        **kwargs,
        true_cfg_scale=adapter.cfg.guidance_scale,
        height=size,
        width=size,
        num_inference_steps=num_steps,
        sigmas=sigmas,
        latents=x,
        output_type=output_type,
        callback_on_step_end=_interrupt_after_first_step(captured),
        callback_on_step_end_tensor_inputs=["latents"],
    ).images
    return out, captured["latents"], adapter.pipe.scheduler.sigmas.clone()


# ----------------------------------------------------------------------------- construction


def test_build_tiny_offline_with_real_classes():
    import diffusers
    import transformers

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    rng_before = torch.get_rng_state()
    adapter = make()
    assert torch.equal(torch.get_rng_state(), rng_before), "tiny init must not consume the global RNG"
    assert isinstance(adapter, FlowAdapter) and adapter.family == FAMILY
    assert type(adapter.pipe) is diffusers.QwenImagePipeline is adapter_class(FAMILY).pipeline_class
    expected = {
        "transformer": diffusers.QwenImageTransformer2DModel,
        "vae": diffusers.AutoencoderKLQwenImage,
        "text_encoder": transformers.Qwen2_5_VLForConditionalGeneration,
        "tokenizer": transformers.Qwen2TokenizerFast,
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler,
    }
    for name, cls in expected.items():
        assert isinstance(getattr(adapter.pipe, name), cls), name
    modules = [m for m in adapter.pipe.components.values() if isinstance(m, torch.nn.Module)]
    for module in modules:
        assert not module.training
        assert all(not p.requires_grad and p.device.type == "cpu" for p in module.parameters())
    assert set(adapter.frozen_modules()) == {adapter.pipe.vae, adapter.pipe.text_encoder}
    # Qwen-Image's published scheduler: exponential dynamic shift, stretched to 0.02
    conf = adapter.pipe.scheduler.config
    assert (conf.time_shift_type, conf.shift_terminal, conf.max_image_seq_len) == ("exponential", 0.02, 8192)
    assert (conf.base_shift, conf.max_shift, conf.use_dynamic_shifting) == (0.5, 0.9, True)


def test_family_facts_match_the_published_vae():
    cls = adapter_class(FAMILY)
    vae = load_arch("qwen-image").vae
    assert (cls.latent_channels, cls.spatial_downsample) == (
        vae["z_dim"],
        2 ** len(vae["temperal_downsample"]),
    )
    assert cls.cfg_as_batch and not cls.is_video_family()


def test_tiny_twin_is_reproducible_from_seed():
    a, b, c = make(), make(), make(tiny_seed=1)
    for name, module in a.pipe.components.items():
        if isinstance(module, torch.nn.Module):
            other = getattr(b.pipe, name).state_dict()
            assert all(torch.equal(v, other[k]) for k, v in module.state_dict().items()), name
    diff = [not torch.equal(p, q) for p, q in zip(a.transformer.parameters(), c.transformer.parameters())]
    assert any(diff)


def test_lora_targets_are_linears_in_every_block(twin):
    linears = {n for n, m in twin.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    for block in range(twin.transformer.config.num_layers):
        for target in twin.default_lora_targets:
            assert f"transformer_blocks.{block}.{target}" in linears, target


def test_keep_high_keeps_embedders_modulation_and_final_projection(twin):
    names = [n for n, m in twin.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    patterns = adapter_class(FAMILY).keep_high
    assert [p for p in patterns if not any(re.fullmatch(p, n) for n in names)] == []  # no dead pattern
    quantized, kept = split_keep_high(names, patterns)
    blocks = range(twin.transformer.config.num_layers)
    assert set(kept) == (
        {"img_in", "txt_in", "norm_out.linear", "proj_out"}
        | {f"time_text_embed.timestep_embedder.linear_{i}" for i in (1, 2)}
        | {f"transformer_blocks.{b}.{s}_mod.1" for b in blocks for s in ("img", "txt")}
    )
    assert {f"transformer_blocks.{b}.{t}" for b in blocks for t in twin.default_lora_targets} <= set(
        quantized
    )


# ----------------------------------------------------------------------------- prompts


def test_template_prefix_the_pipeline_drops_is_exactly_the_system_prompt(twin):
    """The pipeline drops the first ``prompt_template_encode_start_idx`` (34) hidden states:
    with the tiny vocabulary they must be the template's system prefix, as with Qwen2's."""
    pipe, tok = twin.pipe, twin.pipe.tokenizer
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    prefix, suffix = template.split("{}")
    for prompt in PROMPTS:
        ids = tok(template.format(prompt)).input_ids
        assert tok.decode(ids[:drop]) == prefix
        assert tok.decode(ids[drop:]) == prompt + suffix
    assert all(len(tok(s).input_ids) == 1 for s in ("<|im_start|>", "<|im_end|>", "<|image_pad|>"))


def test_encode_prompts_batch_first_padded_and_cached_with_negatives():
    adapter = make()
    calls = []
    original = adapter._encode_uncached

    def counting(prompts):
        calls.append(list(prompts))
        return original(prompts)

    adapter._encode_uncached = counting
    cond = adapter.encode_prompts(["a cat", "two birds in the sky", "a cat"])
    assert calls == [["a cat", "two birds in the sky"]]
    assert set(cond.tensors) == {
        "prompt_embeds",
        "prompt_embeds_mask",
        "negative_prompt_embeds",
        "negative_prompt_embeds_mask",
    }
    length = adapter.cfg.max_sequence_length
    for key, value in cond.tensors.items():
        assert value.shape[:2] == (3, length), key
        assert torch.equal(value[0], value[2]), key
    # the mask marks each prompt's own tokens; padding is zero
    embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_embeds_mask"]
    assert 0 < mask[0].sum() < mask[1].sum() < length
    assert (embeds[mask == 0] == 0).all()
    # the same valid embeddings as the pipeline's own encode_prompt of one prompt alone
    ref, ref_mask = adapter.pipe.encode_prompt(["a cat"], max_sequence_length=length)
    n = ref.shape[1]
    assert ref_mask is None and int(mask[0].sum()) == n
    torch.testing.assert_close(embeds[0, :n], ref[0], atol=1e-6, rtol=0)
    neg, _ = adapter.pipe.encode_prompt([" "], max_sequence_length=length)
    k = neg.shape[1]
    torch.testing.assert_close(cond.tensors["negative_prompt_embeds"][1, :k], neg[0], atol=1e-6, rtol=0)

    again = adapter.encode_prompts(["two birds in the sky", "a bird"])
    assert calls[-1] == ["a bird"]
    for key in cond.tensors:  # cached entries from another batch concatenate and are unchanged
        assert torch.equal(again.tensors[key][0], cond.tensors[key][1]), key


def test_no_negatives_without_cfg():
    adapter = make(guidance_scale=1.0)
    assert set(adapter.encode_prompts(PROMPTS[:2]).tensors) == {"prompt_embeds", "prompt_embeds_mask"}


# ----------------------------------------------------------------------------- latents and decode


def test_latent_shape_and_decode_match_the_pipeline(twin):
    """Packed (h/2 * w/2, 4C) latents; decode = the pipeline's unpack, de-normalisation,
    5D VAE decode and postprocess, for the latents the pipeline itself decodes."""
    assert twin.latent_shape() == (64, 16)  # 32 px, VAE factor 2 -> 16 x 16 -> 8 x 8 tokens of 4 x 4
    images = twin.decode(noise(twin, 2))
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    cond = twin.encode_prompts(PROMPTS[:2])
    out, latents, _ = _pipeline_first_step(twin, cond, noise(twin, 2, seed=5), output_type="pt")
    torch.testing.assert_close(twin.decode(latents), out.float(), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- sigmas


@pytest.mark.parametrize("num_steps", [1, 4, 10])
def test_sigmas_shape_endpoints_monotone(twin, num_steps):
    sig = twin.sigmas(num_steps)
    assert sig.dtype == torch.float32 and sig.shape == (num_steps + 1,)
    assert sig[0].item() == 1.0 and sig[-1].item() == 0.0
    assert (sig[1:] < sig[:-1]).all()
    if num_steps > 1:
        assert sig[-2].item() == pytest.approx(0.02)  # shift_terminal


@pytest.mark.parametrize("size", [32, 64])
@pytest.mark.parametrize("num_steps", [2, 4, 10])
def test_sigmas_are_what_the_pipeline_uses(size, num_steps):
    """Against the pipeline's own scheduler after a real call at that size (mu depends on
    the image sequence length)."""
    adapter = make(height=size, width=size)
    cond = adapter.encode_prompts(PROMPTS[:1])
    _, _, used = _pipeline_first_step(adapter, cond, noise(adapter, 1), num_steps=num_steps)
    torch.testing.assert_close(adapter.sigmas(num_steps), used.float(), atol=0, rtol=0)


@pytest.mark.parametrize("size", [32, 64])
def test_sigmas_match_exponential_shift_and_terminal_stretch(size):
    """sigma = e^mu / (e^mu + 1/s - 1), mu linear in the packed sequence length, then
    1 - (1 - sigma) * (1 - terminal) / (1 - sigma_last)."""
    adapter = make(height=size, width=size)
    conf = adapter.pipe.scheduler.config
    seq_len = (size // adapter.pipe.vae_scale_factor // 2) ** 2
    slope = (conf.max_shift - conf.base_shift) / (conf.max_image_seq_len - conf.base_image_seq_len)
    mu = conf.base_shift + slope * (seq_len - conf.base_image_seq_len)
    n = 8
    s = np.linspace(1.0, 1.0 / n, n)
    shifted = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    stretched = 1 - (1 - shifted) * (1 - conf.shift_terminal) / (1 - shifted[-1])
    np.testing.assert_allclose(adapter.sigmas(n).numpy(), np.append(stretched, 0.0), atol=1e-6)


def test_sigmas_depend_on_resolution_and_leave_the_pipeline_scheduler_alone():
    adapter = make()
    adapter.pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 3, 3), mu=0.5)
    before = adapter.pipe.scheduler.sigmas.clone()
    assert not torch.allclose(adapter.sigmas(6), make(height=64, width=64).sigmas(6))
    assert torch.equal(adapter.pipe.scheduler.sigmas, before)


def test_one_step_schedule_is_nan_in_the_pipeline_and_one_euler_step_here(twin):
    """linspace(1, 1, 1) stretched to shift_terminal is 0/0: the deliberate deviation."""
    scheduler = type(twin.pipe.scheduler).from_config(twin.pipe.scheduler.config)
    with np.errstate(invalid="ignore", divide="ignore"):
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0, 1), mu=0.5)
    assert torch.isnan(scheduler.sigmas[0])
    assert twin.sigmas(1).tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- velocity


def test_velocity_batch_invariance(twin):
    cond = twin.encode_prompts(PROMPTS)
    x = noise(twin, 4)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.1])
    v4 = twin.velocity(twin.transformer, x, sigma, cond, guidance=True)
    assert v4.shape == x.shape and v4.dtype == torch.float32 and torch.isfinite(v4).all()
    for i in range(4):
        v1 = twin.velocity(twin.transformer, x[i : i + 1], sigma[i : i + 1], cond.select([i]))
        torch.testing.assert_close(v1, v4[i : i + 1], atol=1e-5, rtol=0)


def test_true_cfg_is_rescaled_to_the_conditional_norm(twin):
    """QwenImagePipeline: comb = v_u + s (v_c - v_u), then comb * ||v_c|| / ||comb|| per token."""
    cond = twin.encode_prompts(PROMPTS[:2])
    x, sigma = noise(twin, 2), torch.tensor([0.9, 0.3])
    uncond = Conditioning({k: cond.tensors[f"negative_{k}"] for k in twin.cond_keys})
    v_c = twin.velocity(twin.transformer, x, sigma, cond, guidance=False)
    v_u = twin.velocity(twin.transformer, x, sigma, uncond, guidance=False)
    v = twin.velocity(twin.transformer, x, sigma, cond, guidance=True)
    comb = v_u + twin.cfg.guidance_scale * (v_c - v_u)
    torch.testing.assert_close(v, comb * v_c.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(v.norm(dim=-1), v_c.norm(dim=-1))
    assert (v - v_c).abs().max() > 1e-3 and (v - comb).abs().max() > 1e-3


@pytest.mark.parametrize("sigmas", [None, [0.7, 0.3]], ids=["from_noise", "mid_schedule"])
@pytest.mark.parametrize("guidance_scale", [4.0, 1.0], ids=["cfg", "no_cfg"])
def test_velocity_matches_one_step_of_the_real_pipeline(guidance_scale, sigmas):
    """Timestep scaling, true CFG with its rescale, masks and latent layout agree with
    diffusers' own sampler: its first Euler step is x + (sigma_1 - sigma_0) v."""
    adapter = make(guidance_scale=guidance_scale)
    cond = adapter.encode_prompts(PROMPTS[:2])
    x = noise(adapter, 2, seed=3)
    out, _, used = _pipeline_first_step(adapter, cond, x, sigmas=sigmas)
    assert (used[0] < 1.0) == (sigmas is not None)
    v = adapter.velocity(adapter.transformer, x, torch.full((2,), float(used[0])), cond)
    torch.testing.assert_close(out.float(), x + (used[1] - used[0]) * v, atol=1e-5, rtol=1e-5)


def test_bf16_weights_give_fp32_velocity():
    adapter = make(dtype="bfloat16")
    assert adapter.transformer.dtype == torch.bfloat16
    cond = adapter.encode_prompts(PROMPTS[:2])
    v = adapter.velocity(adapter.transformer, noise(adapter, 2), torch.tensor([0.7, 0.2]), cond)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    images = adapter.decode(noise(adapter, 1))
    assert images.dtype == torch.float32 and torch.isfinite(images).all()


# ----------------------------------------------------------------------------- loading and LoRA


def test_from_pretrained_local_directory(tmp_path):
    """A saved diffusers directory loads, frozen, with the same tokens and velocity."""
    tiny_twin = make()
    tiny_twin.pipe.save_pretrained(tmp_path)
    loaded = make(pretrained=str(tmp_path))
    assert type(loaded.pipe) is type(tiny_twin.pipe)
    assert not loaded.transformer.training and not any(
        p.requires_grad for p in loaded.transformer.parameters()
    )
    x, sigma = noise(tiny_twin, 1), torch.tensor([0.6])
    v_ref = tiny_twin.velocity(tiny_twin.transformer, x, sigma, tiny_twin.encode_prompts(PROMPTS[:1]))
    v = loaded.velocity(loaded.transformer, x, sigma, loaded.encode_prompts(PROMPTS[:1]))
    torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)


def test_lora_round_trip_through_load_lora_weights(tmp_path):
    """Trained LoRA -> adapter.save_lora -> fresh pipeline.load_lora_weights gives the same
    velocity; alpha != rank, so the saved LoraConfig metadata matters."""
    adapter = make()
    cond = adapter.encode_prompts(PROMPTS[:2])
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.4])
    base = adapter.velocity(adapter.transformer, x, sigma, cond)
    add_random_lora(adapter)
    tuned = adapter.velocity(adapter.transformer, x, sigma, cond)
    assert (tuned - base).abs().max() > 1e-3

    state = lora_state(adapter)
    adapter.save_lora(tmp_path, state)
    fresh = make()
    fresh.pipe.load_lora_weights(tmp_path)
    reloaded = fresh.velocity(fresh.transformer, x, sigma, fresh.encode_prompts(PROMPTS[:2]))
    torch.testing.assert_close(reloaded, tuned, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- full size


def test_arch_file_names_itself_and_the_hub_id():
    from diffrl.models.qwenimage import TINY_TEXT_VOCAB

    raw = json.loads((ARCH_DIR / "qwen-image.json").read_text())
    assert (raw["name"], raw["family"], raw["hub_ids"]) == ("qwen-image", FAMILY, ["Qwen/Qwen-Image"])
    # a text_config override replaces the twin's whole sub-config, so it repeats its vocabulary
    assert raw["text_overrides"]["text_encoder"]["text_config"]["vocab_size"] == TINY_TEXT_VOCAB


def test_random_qwen_image_builds_on_meta_at_the_published_size():
    arch = load_arch("qwen-image")
    adapter = build_adapter(
        make_cfg(FAMILY, pretrained="random:qwen-image", height=512, width=512), device="meta"
    )
    params = sum(p.numel() for p in adapter.transformer.parameters())
    assert all(p.is_meta for p in adapter.transformer.parameters())
    assert abs(params / arch.published_params - 1) < 0.12
    assert params == 20_430_401_088  # the diffusers QwenImageTransformer2DModel of Qwen/Qwen-Image
    assert adapter.pipe.vae_scale_factor == 8
    assert tuple(adapter.latent_shape()) == (1024, 64)  # 512 px: (512 / 16)^2 tokens of 2x2x16
    cond = adapter.encode_prompts(["a cat", "a dog"])
    for key in ("prompt_embeds", "negative_prompt_embeds"):
        assert tuple(cond.tensors[key].shape[1:]) == (16, 3584) and cond.tensors[key].is_meta
    x = torch.zeros((2, *adapter.latent_shape()), device="meta")
    v = adapter.velocity(adapter.transformer, x, torch.full((2,), 0.5, device="meta"), cond)
    assert v.shape == x.shape and v.is_meta
