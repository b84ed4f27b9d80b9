"""FLUX.2 [klein] adapter (``diffrl.models.flux2``) on its tiny twin, offline on CPU.

The checks tests/models/test_adapters.py runs for every family, for flux2, plus what is
particular to it: the sigma grid read back from a real pipeline run (BFL's empirical mu
depends on the step count), CFG on base models and none on distilled ones, the
batch-norm latent statistics in decoding, and the published klein-4B architecture.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from diffrl.models import adapter_class, build_adapter
from diffrl.models.arch import ARCH_DIR, load_arch
from diffrl.models.base import Conditioning, FlowAdapter
from diffrl.precision.keep_high import split_keep_high
from tests.models.lora import add_random_lora, lora_state
from tests.models.test_adapters import PROMPTS, make_cfg, noise

FAMILY = "flux2"


def make(**overrides):
    return build_adapter(make_cfg(FAMILY, **overrides))  # 32x32, max_sequence_length 16, CFG 4.0


def make_distilled(**overrides):
    """The tiny twin as a step-distilled klein model (``is_distilled: true``)."""
    adapter = make(**overrides)
    adapter.pipe.register_to_config(is_distilled=True)
    return adapter


def _pipeline_input(adapter, packed):
    """Packed tokens (B, h/2 * w/2, C) in the layout ``Flux2KleinPipeline(latents=...)``
    takes: the patchified (B, C, h/2, w/2), which it packs itself."""
    h, w = adapter._latent_hw()
    return packed.transpose(1, 2).reshape(packed.shape[0], packed.shape[2], h // 2, w // 2)


def _packed_from_pipeline_output(adapter, latents):
    """The pipeline's ``output_type="latent"`` result (unpatchified, batch-norm undone) back
    to packed normalised tokens, with the pipeline's encode-side helpers
    (``_encode_vae_image`` then ``_pack_latents``): the inverse of what it did."""
    pipe = adapter.pipe
    x = pipe._patchify_latents(latents.float())
    bn = pipe.vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1).float()
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1).float() + pipe.vae.config.batch_norm_eps)
    return pipe._pack_latents((x - mean) / std)


def _run_pipeline(adapter, cond, x, steps=1, output_type="latent"):
    """The real pipeline from ``x`` (packed), with the adapter's embeddings."""
    extra = {}
    if "negative_prompt_embeds" in cond.tensors:
        extra["negative_prompt_embeds"] = cond.tensors["negative_prompt_embeds"]
    return adapter.pipe(
        prompt_embeds=cond.tensors["prompt_embeds"],
        latents=_pipeline_input(adapter, x),
        num_inference_steps=steps,
        guidance_scale=adapter.cfg.guidance_scale,
        height=adapter.cfg.height,
        width=adapter.cfg.width,
        output_type=output_type,
        **extra,
    ).images


# ----------------------------------------------------------------------------- construction


def test_build_tiny_offline_with_real_classes():
    import diffusers
    import transformers

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    rng_before = torch.get_rng_state()
    adapter = make()
    assert torch.equal(torch.get_rng_state(), rng_before), "tiny init must not consume the global RNG"
    assert isinstance(adapter, FlowAdapter) and adapter.family == FAMILY
    assert not adapter.is_video_family()
    assert isinstance(adapter.pipe, diffusers.Flux2KleinPipeline)
    expected = {
        "transformer": diffusers.Flux2Transformer2DModel,
        "vae": diffusers.AutoencoderKLFlux2,
        "text_encoder": transformers.Qwen3ForCausalLM,
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
    assert not adapter.pipe.config.is_distilled  # a base model: CFG is exercised
    # the pipeline's default text_encoder_out_layers (9, 18, 27) are intermediate layers
    assert adapter.pipe.text_encoder.config.num_hidden_layers > 27


def test_tokenizer_renders_qwen3s_chat_template():
    tok = make().pipe.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "a red dog"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert text == "<|im_start|>user\na red dog<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    tokens = tok.convert_ids_to_tokens(tok(text)["input_ids"])
    assert tokens[:3] == ["<|im_start|>", "user", "\u010a"] and "<|im_end|>" in tokens


def test_tiny_twin_is_reproducible_from_seed():
    a, b, c = make(), make(), make(tiny_seed=1)
    for name, module in a.pipe.components.items():
        if isinstance(module, torch.nn.Module):
            other = getattr(b.pipe, name).state_dict()
            assert all(torch.equal(v, other[k]) for k, v in module.state_dict().items()), name
    diff = [not torch.equal(p, q) for p, q in zip(a.transformer.parameters(), c.transformer.parameters())]
    assert any(diff)
    # the VAE's batch-norm statistics are seeded too
    assert not torch.equal(a.pipe.vae.bn.running_mean, c.pipe.vae.bn.running_mean)


def test_lora_targets_exist_in_transformer():
    adapter = make()
    linears = [n for n, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in adapter.default_lora_targets:
        assert any(n == target or n.endswith("." + target) for n in linears), target
    singles = adapter.transformer.config.num_single_layers
    per_block = {f"single_transformer_blocks.{i}.attn.to_out" for i in range(singles)}
    assert set(adapter.default_lora_targets) == set(adapter_class(FAMILY).default_lora_targets) | per_block
    # every projection of both block kinds is covered, the fused single-block ones included
    covered = {n for n in linears if any(n == t or n.endswith("." + t) for t in adapter.default_lora_targets)}
    blocks = [n for n in linears if n.startswith(("transformer_blocks.", "single_transformer_blocks."))]
    assert covered == set(blocks)


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("variant", ["base", "base_no_cfg", "distilled"])
def test_encode_prompts_batch_first_and_cached(variant):
    adapter = {
        "base": make,
        "base_no_cfg": lambda: make(guidance_scale=1.0),
        "distilled": make_distilled,
    }[variant]()
    calls = []
    original = adapter._encode_uncached

    def counting(prompts):
        calls.append(list(prompts))
        return original(prompts)

    adapter._encode_uncached = counting
    cond = adapter.encode_prompts(["a cat", "a dog", "a cat"])
    assert calls == [["a cat", "a dog"]]
    assert len(cond) == 3
    for key, value in cond.tensors.items():
        assert value.shape[0] == 3, key
        assert torch.equal(value[0], value[2]), key
    assert ("negative_prompt_embeds" in cond.tensors) == (variant == "base")
    # padded to max_sequence_length, three Qwen3 layers concatenated per token
    assert cond.tensors["prompt_embeds"].shape[1:] == (16, 3 * adapter.pipe.text_encoder.config.hidden_size)
    assert cond.tensors["prompt_embeds"].shape[2] == adapter.transformer.config.joint_attention_dim

    again = adapter.encode_prompts(["a dog", "a bird"])
    assert calls == [["a cat", "a dog"], ["a bird"]]
    for key in cond.tensors:
        assert torch.equal(again.tensors[key][0], cond.tensors[key][1]), key


def test_negative_is_the_pipelines_empty_prompt():
    adapter = make()
    cond = adapter.encode_prompts(PROMPTS[:2])
    empty, _ = adapter.pipe.encode_prompt(prompt=["", ""], max_sequence_length=16)
    torch.testing.assert_close(cond.tensors["negative_prompt_embeds"], empty)


# ----------------------------------------------------------------------------- latents and decode


def test_latent_shape_and_decode_range():
    adapter = make()
    # 32 px / 2 (tiny VAE) / 2 (patchify) = 8x8 tokens of 4 x 2x2 channels
    assert adapter.latent_shape() == (64, 16)
    images = adapter.decode(noise(adapter, 2))
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1


def test_decode_matches_the_pipelines_images():
    """One step from x reaches x - v; the pipeline's own decode of that (batch-norm
    statistics undone, unpatchified, VAE, postprocessed) is the adapter's decode."""
    adapter = make()
    cond = adapter.encode_prompts(PROMPTS[:2])
    x = noise(adapter, 2, seed=5)
    images = _run_pipeline(adapter, cond, x, output_type="pt")
    v = adapter.velocity(adapter.transformer, x, torch.ones(2), cond)
    torch.testing.assert_close(adapter.decode(x - v), images.float(), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- sigmas


@pytest.mark.parametrize("size", [32, 64])
@pytest.mark.parametrize("num_steps", [1, 4, 10])
def test_sigmas_are_the_pipelines_own(size, num_steps):
    """Run the real pipeline for ``num_steps`` and read its scheduler's grid back."""
    adapter = make_distilled(height=size, width=size)  # no CFG: half the transformer calls
    sig = adapter.sigmas(num_steps)
    assert sig.dtype == torch.float32 and sig.shape == (num_steps + 1,)
    assert sig[0].item() == 1.0 and sig[-1].item() == 0.0 and (sig[1:] < sig[:-1]).all()
    cond = adapter.encode_prompts(PROMPTS[:1])
    _run_pipeline(adapter, cond, noise(adapter, 1), steps=num_steps)
    torch.testing.assert_close(sig, adapter.pipe.scheduler.sigmas.float().cpu(), atol=0, rtol=0)


def test_sigmas_depend_on_resolution_and_step_count():
    """BFL's empirical mu depends on both (FLUX.1's only on the resolution), and the
    pipeline's scheduler is left alone."""
    small, large = make(), make(height=64, width=64)
    assert not torch.allclose(small.sigmas(6), large.sigmas(6))
    before = small.pipe.scheduler.sigmas.clone()
    four, eight = small.sigmas(4), small.sigmas(8)
    assert torch.equal(small.pipe.scheduler.sigmas, before)
    # the 4-step grid is not every other point of the 8-step one: mu moved with N
    assert not torch.allclose(four, eight[::2], atol=1e-4)


# ----------------------------------------------------------------------------- velocity


def test_velocity_batch_invariance():
    adapter = make()
    cond = adapter.encode_prompts(PROMPTS)
    x = noise(adapter, 4)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.1])
    v4 = adapter.velocity(adapter.transformer, x, sigma, cond, guidance=True)
    assert v4.shape == x.shape and v4.dtype == torch.float32 and torch.isfinite(v4).all()
    for i in range(4):
        v1 = adapter.velocity(adapter.transformer, x[i : i + 1], sigma[i : i + 1], cond.select([i]))
        torch.testing.assert_close(v1, v4[i : i + 1], atol=1e-5, rtol=0)


def test_cfg_combines_uncond_and_cond_on_base_models():
    adapter = make()
    cond = adapter.encode_prompts(PROMPTS[:2])
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.3])
    uncond = Conditioning({"prompt_embeds": cond.tensors["negative_prompt_embeds"]})
    v_c = adapter.velocity(adapter.transformer, x, sigma, cond, guidance=False)
    v_u = adapter.velocity(adapter.transformer, x, sigma, uncond, guidance=False)
    v = adapter.velocity(adapter.transformer, x, sigma, cond, guidance=True)
    s = adapter.cfg.guidance_scale
    torch.testing.assert_close(v, v_u + s * (v_c - v_u), atol=1e-5, rtol=1e-5)
    assert (v - v_c).abs().max() > 1e-3


def test_distilled_models_ignore_the_guidance_scale():
    adapter = make_distilled()
    assert not adapter.do_cfg
    cond = adapter.encode_prompts(PROMPTS[:2])
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.3])
    v = adapter.velocity(adapter.transformer, x, sigma, cond)
    torch.testing.assert_close(adapter.velocity(adapter.transformer, x, sigma, cond, guidance=False), v)
    adapter.cfg.guidance_scale = 1.0
    torch.testing.assert_close(adapter.velocity(adapter.transformer, x, sigma, cond), v)


@pytest.mark.parametrize("variant", ["base", "distilled"])
def test_velocity_matches_one_step_of_the_real_pipeline(variant):
    """Timestep scaling, position ids, CFG and latent layout agree with diffusers' own
    sampler: one FlowMatchEuler step from sigma = 1 is x - v."""
    adapter = make() if variant == "base" else make_distilled()
    cond = adapter.encode_prompts(PROMPTS[:2])
    x = noise(adapter, 2, seed=3)
    out = _packed_from_pipeline_output(adapter, _run_pipeline(adapter, cond, x))
    v = adapter.velocity(adapter.transformer, x, torch.ones(2), cond)
    torch.testing.assert_close(out, x - v, atol=1e-5, rtol=1e-5)


def test_bf16_weights_give_fp32_velocity():
    adapter = make(dtype="bfloat16")
    assert adapter.transformer.dtype == torch.bfloat16
    cond = adapter.encode_prompts(PROMPTS[:2])
    v = adapter.velocity(adapter.transformer, noise(adapter, 2), torch.tensor([0.7, 0.2]), cond)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    images = adapter.decode(noise(adapter, 2))
    assert images.dtype == torch.float32 and torch.isfinite(images).all()


# ----------------------------------------------------------------------------- loading


def test_from_pretrained_local_directory(tmp_path):
    """A saved diffusers directory loads, frozen, with the same velocity; is_distilled and
    the tokenizer's chat template survive the round trip."""
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

    distilled = make_distilled()
    distilled.pipe.save_pretrained(tmp_path / "distilled")
    assert make(pretrained=str(tmp_path / "distilled"), guidance_scale=1.0).pipe.config.is_distilled


def test_lora_round_trip_through_load_lora_weights(tmp_path):
    """Trained LoRA -> adapter.save_lora -> fresh pipeline.load_lora_weights gives the same
    velocity, with alpha != rank (kept by the saved LoraConfig metadata)."""
    adapter = make()
    cond = adapter.encode_prompts(PROMPTS[:2])
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.4])
    base = adapter.velocity(adapter.transformer, x, sigma, cond)

    add_random_lora(adapter)
    tuned = adapter.velocity(adapter.transformer, x, sigma, cond)
    assert (tuned - base).abs().max() > 1e-3

    state = lora_state(adapter)
    assert "single_transformer_blocks.1.attn.to_out.lora_A.weight" in state  # the fused outputs train too
    adapter.save_lora(tmp_path, state)
    fresh = make()
    fresh.pipe.load_lora_weights(tmp_path)
    reloaded = fresh.velocity(fresh.transformer, x, sigma, fresh.encode_prompts(PROMPTS[:2]))
    torch.testing.assert_close(reloaded, tuned, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- keep-high


def test_keep_high_keeps_embedders_shared_modulation_and_final_projection():
    adapter = make()
    linears = [n for n, m in adapter.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    patterns = adapter_class(FAMILY).keep_high
    assert [p for p in patterns if not any(re.fullmatch(p, n) for n in linears)] == []  # none dead
    quantized, kept = split_keep_high(linears, patterns)
    assert set(kept) == {
        "x_embedder",
        "context_embedder",
        "time_guidance_embed.timestep_embedder.linear_1",
        "time_guidance_embed.timestep_embedder.linear_2",
        "double_stream_modulation_img.linear",
        "double_stream_modulation_txt.linear",
        "single_stream_modulation.linear",
        "norm_out.linear",
        "proj_out",
    }
    singles = range(adapter.transformer.config.num_single_layers)
    fused = {
        f"single_transformer_blocks.{b}.attn.{n}" for b in singles for n in ("to_qkv_mlp_proj", "to_out")
    }
    assert fused <= set(quantized)


# ----------------------------------------------------------------------------- published architecture


def test_random_klein_4b_builds_on_meta_with_the_published_size():
    """``random:flux2-klein-4b`` at a real size: the transformer has the model card's
    parameter count, the text width matches joint_attention_dim, and latent_numel (the
    run plan's trajectory size, from class facts) is the packed latent's element count,
    including the pipeline's rounding to 16 px (1000 -> 992)."""
    cfg = make_cfg(FAMILY, pretrained="random:flux2-klein-4b", height=1000, width=720)
    adapter = build_adapter(cfg, device="meta")
    arch = load_arch("flux2-klein-4b")
    params = sum(p.numel() for p in adapter.transformer.parameters())
    assert all(p.is_meta for p in adapter.transformer.parameters())
    assert abs(params / arch.published_params - 1) < 0.12, params
    assert adapter.latent_shape() == ((1000 // 16) * (720 // 16), 128)
    assert adapter_class(FAMILY).latent_numel(cfg) == math.prod(adapter.latent_shape())
    cond = adapter.encode_prompts(["a cat", "a dog"])
    assert (
        tuple(cond.tensors["prompt_embeds"].shape[1:]) == (16, 7680) and cond.tensors["prompt_embeds"].is_meta
    )
    x = torch.zeros((2, *adapter.latent_shape()), device="meta")
    v = adapter.velocity(adapter.transformer, x, torch.full((2,), 0.5, device="meta"), cond)
    assert v.shape == x.shape and v.is_meta


def test_family_latent_facts_match_the_published_vae():
    spec = json.loads((ARCH_DIR / "flux2-klein-4b.json").read_text())
    cls = adapter_class(spec["family"])
    vae = spec["vae"]
    assert (cls.latent_channels, cls.spatial_downsample) == (
        vae["latent_channels"],
        2 ** (len(vae["block_out_channels"]) - 1),
    )
    assert cls.cfg_as_batch  # base models run CFG as a negative batch
    for size in (512, 1024):
        cfg = make_cfg(FAMILY, height=size, width=size)
        assert cls.latent_numel(cfg) == 128 * (size // 16) ** 2


def test_a_distilled_model_with_a_guidance_scale_is_refused_at_load(tmp_path):
    """The pipeline would ignore the scale and the run plan would count CFG forwards: one
    error naming the fix instead."""
    from diffrl.config import ConfigError

    make_distilled().pipe.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="step-distilled and ignores CFG.*set model.guidance_scale: 1"):
        make(pretrained=str(tmp_path))
    assert not make(pretrained=str(tmp_path), guidance_scale=1.0).do_cfg
