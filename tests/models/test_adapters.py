"""Tiny-twin tests for the four diffusers adapters (flux, sd3, sana, wan), all offline on CPU.

Besides shapes and caching, these pin the conventions that are easy to get wrong: the
sigma schedules against closed-form references, the velocity against one step of the
real diffusers pipeline, CFG, batch-size invariance, and a LoRA save/load round trip.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from diffrl.config import ModelConfig
from diffrl.models import ModelLoadError, adapter_class, build_adapter
from diffrl.models.base import Conditioning, FlowAdapter
from diffrl.models.loading import torch_dtype
from tests.models.lora import add_random_lora, lora_state

FAMILIES = ["flux", "sd3", "sana", "wan"]
# every family loaded through load_pipeline: the loading-error tests cover them all
LOADED_FAMILIES = FAMILIES + ["flux_kontext", "flux2", "qwenimage", "qwenimage_edit", "wan22"]
CFG_FAMILIES = ["sd3", "sana", "wan"]
PROMPTS = ["a photo of a cat", "a red dog", "two birds in the sky", "an old house near the sea"]


def make_cfg(family: str, **overrides) -> ModelConfig:
    kw = dict(
        family=family,
        pretrained="tiny",
        height=32,
        width=32,
        num_frames=5,
        guidance_scale=3.5 if family == "flux" else 4.0,
        max_sequence_length=16,
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def make(family: str, **overrides):
    return build_adapter(make_cfg(family, **overrides))


def noise(adapter, batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, *adapter.latent_shape(), generator=torch.Generator().manual_seed(seed))


# component -> class name (looked up in diffusers, then transformers): the real pipeline classes
EXPECTED_CLASSES = {
    "flux": "transformer=FluxTransformer2DModel vae=AutoencoderKL text_encoder=CLIPTextModel "
    "text_encoder_2=T5EncoderModel tokenizer=CLIPTokenizer tokenizer_2=T5TokenizerFast "
    "scheduler=FlowMatchEulerDiscreteScheduler",
    "sd3": "transformer=SD3Transformer2DModel vae=AutoencoderKL text_encoder=CLIPTextModelWithProjection "
    "text_encoder_2=CLIPTextModelWithProjection text_encoder_3=T5EncoderModel tokenizer=CLIPTokenizer "
    "tokenizer_3=T5TokenizerFast scheduler=FlowMatchEulerDiscreteScheduler",
    "sana": "transformer=SanaTransformer2DModel vae=AutoencoderDC text_encoder=Gemma2Model "
    "tokenizer=GemmaTokenizerFast scheduler=DPMSolverMultistepScheduler",
    "wan": "transformer=WanTransformer3DModel vae=AutoencoderKLWan text_encoder=UMT5EncoderModel "
    "tokenizer=T5TokenizerFast scheduler=UniPCMultistepScheduler",
}


def expected_classes(family):
    import diffusers
    import transformers

    pairs = (item.split("=") for item in EXPECTED_CLASSES[family].split())
    return {name: getattr(diffusers, cls, None) or getattr(transformers, cls) for name, cls in pairs}


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("family", FAMILIES)
def test_build_tiny_offline_with_real_classes(family):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    rng_before = torch.get_rng_state()
    adapter = make(family)
    assert torch.equal(torch.get_rng_state(), rng_before), "tiny init must not consume the global RNG"
    assert isinstance(adapter, FlowAdapter) and adapter.family == family
    assert adapter.is_video_family() == (family == "wan")
    assert isinstance(adapter.pipe, adapter_class(family).pipeline_class)
    for name, cls in expected_classes(family).items():
        assert isinstance(getattr(adapter.pipe, name), cls), name
    modules = [m for m in adapter.pipe.components.values() if isinstance(m, torch.nn.Module)]
    for module in modules:
        assert not module.training
        assert all(not p.requires_grad and p.device.type == "cpu" for p in module.parameters())
    assert set(adapter.frozen_modules()) <= set(modules)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_twin_is_reproducible_from_seed(family):
    a, b, c = make(family), make(family), make(family, tiny_seed=1)
    for name, module in a.pipe.components.items():
        if isinstance(module, torch.nn.Module):
            other = getattr(b.pipe, name).state_dict()
            assert all(torch.equal(v, other[k]) for k, v in module.state_dict().items()), name
    diff = [not torch.equal(p, q) for p, q in zip(a.transformer.parameters(), c.transformer.parameters())]
    assert any(diff)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_exist_in_transformer(family):
    adapter = make(family)
    names = [n for n, _ in adapter.transformer.named_modules()]
    for target in adapter.default_lora_targets:
        assert any(n == target or n.endswith("." + target) for n in names), target


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_prompts_batch_first_and_cached(family):
    adapter = make(family)
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
    expect_neg = family in CFG_FAMILIES
    assert any(k.startswith("negative_") for k in cond.tensors) == expect_neg
    assert cond.tensors["prompt_embeds"].shape[1] >= adapter.cfg.max_sequence_length

    again = adapter.encode_prompts(["a dog", "a bird"])
    assert calls == [["a cat", "a dog"], ["a bird"]]
    for key in cond.tensors:
        assert torch.equal(again.tensors[key][0], cond.tensors[key][1]), key


# ----------------------------------------------------------------------------- latents and decode


@pytest.mark.parametrize("family", FAMILIES)
def test_latent_shape_and_decode_range(family):
    adapter = make(family)
    expected = {"flux": (64, 16), "sd3": (4, 16, 16), "sana": (4, 16, 16), "wan": (16, 2, 4, 4)}[family]
    assert adapter.latent_shape() == expected
    images = adapter.decode(noise(adapter, 2))
    shape = (2, 5, 3, 32, 32) if family == "wan" else (2, 3, 32, 32)
    assert images.shape == shape and images.dtype == torch.float32
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1


# ----------------------------------------------------------------------------- sigmas


@pytest.mark.parametrize("num_steps", [1, 4, 10])
@pytest.mark.parametrize("family", FAMILIES)
def test_sigmas_shape_endpoints_monotone(family, num_steps):
    sig = make(family).sigmas(num_steps)
    assert sig.dtype == torch.float32 and sig.shape == (num_steps + 1,)
    # DPM-Solver / UniPC grids (sana, wan) start just below pure noise, as their pipelines do
    assert (sig[0].item() == 1.0) if family not in ("sana", "wan") else (0.999 < sig[0].item() < 1.0)
    assert sig[-1].item() == 0.0
    assert (sig[1:] < sig[:-1]).all()


@pytest.mark.parametrize("size", [32, 64])
def test_flux_sigmas_match_dynamic_shift_formula(size):
    """sigma = e^mu / (e^mu + 1/s - 1), mu linear in the packed image sequence length."""
    adapter = make("flux", height=size, width=size)
    conf = adapter.pipe.scheduler.config
    seq_len = (size // adapter.pipe.vae_scale_factor // 2) ** 2
    slope = (conf.max_shift - conf.base_shift) / (conf.max_image_seq_len - conf.base_image_seq_len)
    mu = conf.base_shift + slope * (seq_len - conf.base_image_seq_len)
    n = 8
    s = np.linspace(1.0, 1.0 / n, n)
    ref = np.append(math.exp(mu) / (math.exp(mu) + (1 / s - 1)), 0.0)
    np.testing.assert_allclose(adapter.sigmas(n).numpy(), ref, atol=1e-6)


def test_flux_truncated_timestep_is_dancegrpos_int_of_a_thousand_sigma():
    """model.truncate_timestep: the transformer reads int(sigma * 1000) / 1000 (DanceGRPO's
    train_grpo_flux.py: timestep_value = int(sigma * 1000), passed / 1000), the float32 product
    truncated toward zero; by default (1000 sigma in the weights' dtype) / 1000, as FluxPipeline."""
    sigmas = torch.tensor([1.0, 0.9997, 0.3, 0.1234567, 0.0009], dtype=torch.float32)
    dance = make("flux", truncate_timestep=True)._timestep(sigmas, torch.float32)
    by_hand = torch.tensor([int(float(s) * 1000) / 1000 for s in sigmas * 1])
    expected = torch.tensor([int(v) for v in (sigmas * 1000).tolist()], dtype=torch.float32) / 1000
    torch.testing.assert_close(dance, expected, rtol=0, atol=0)
    assert dance.tolist()[:3] == pytest.approx([1.0, 0.999, 0.3]) and dance[-1] == 0
    assert (by_hand - dance).abs().max() <= 1e-3  # the same grid whether the product is taken in fp32 or fp64
    plain = make("flux")._timestep(sigmas, torch.float32)
    torch.testing.assert_close(plain, sigmas)
    assert not torch.equal(plain, dance)


def test_flux_sigmas_depend_on_resolution():
    assert not torch.allclose(
        make("flux", height=32, width=32).sigmas(6), make("flux", height=64, width=64).sigmas(6)
    )


def test_sd3_sigmas_match_shift_formula_on_diffusers_grid():
    """diffusers' grid is linspace(1, sigma_min, N) with sigma_min the *shifted* 1/T, then shifted."""
    adapter = make("sd3")
    shift, steps = adapter.pipe.scheduler.config.shift, adapter.pipe.scheduler.config.num_train_timesteps

    def shifted(s):
        return shift * s / (1 + (shift - 1) * s)

    n = 8
    ref = np.append(shifted(np.linspace(1.0, shifted(1.0 / steps), n)), 0.0)
    np.testing.assert_allclose(adapter.sigmas(n).numpy(), ref, atol=1e-6)


def _shifted(s, shift):
    return shift * s / (1 + (shift - 1) * s)


@pytest.mark.parametrize("n", [1, 8, 10])
def test_sana_sigmas_are_dpm_solvers_flow_grid(n):
    """diffusers DPMSolverMultistepScheduler (use_flow_sigmas): sigma = shift(1 - alpha) for
    alpha = linspace(1, 1/T, N + 1), flipped, the last (0) dropped, then a final 0."""
    adapter = make("sana")
    conf = adapter.pipe.scheduler.config
    grid = _shifted(1.0 - np.linspace(1, 1 / conf.num_train_timesteps, n + 1), conf.flow_shift)[::-1][:-1]
    np.testing.assert_allclose(adapter.sigmas(n).numpy(), np.append(grid, 0.0), rtol=0, atol=1e-7)


@pytest.mark.parametrize("n", [1, 8, 10])
def test_wan_sigmas_are_unipcs_flow_grid(n):
    """diffusers UniPCMultistepScheduler (use_flow_sigmas): sigma = shift(linspace(1, 1/T,
    N + 1)[:-1]), the first moved 1e-6 below 1, then a final 0."""
    adapter = make("wan")
    conf = adapter.pipe.scheduler.config
    grid = _shifted(np.linspace(1, 1 / conf.num_train_timesteps, n + 1)[:-1], conf.flow_shift)
    grid[0] -= 1e-6
    np.testing.assert_allclose(adapter.sigmas(n).numpy(), np.append(grid, 0.0), rtol=0, atol=1e-7)


@pytest.mark.parametrize("family", ["sana", "wan"])
def test_sigmas_leave_the_pipelines_scheduler_untouched(family):
    adapter = make(family)
    before = adapter.pipe.scheduler.num_inference_steps
    adapter.sigmas(7)
    assert adapter.pipe.scheduler.num_inference_steps == before


# ----------------------------------------------------------------------------- velocity


@pytest.mark.parametrize("family", FAMILIES)
def test_velocity_batch_invariance(family):
    adapter = make(family)
    cond = adapter.encode_prompts(PROMPTS)
    x = noise(adapter, 4)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.1])
    v4 = adapter.velocity(adapter.transformer, x, sigma, cond, guidance=True)
    assert v4.shape == x.shape and v4.dtype == torch.float32 and torch.isfinite(v4).all()
    for i in range(4):
        v1 = adapter.velocity(adapter.transformer, x[i : i + 1], sigma[i : i + 1], cond.select([i]))
        torch.testing.assert_close(v1, v4[i : i + 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", CFG_FAMILIES)
def test_cfg_combines_uncond_and_cond(family):
    adapter = make(family)
    cond = adapter.encode_prompts(PROMPTS[:2])
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.3])
    uncond = Conditioning({k: cond.tensors[f"negative_{k}"] for k in adapter.cond_keys})
    v_c = adapter.velocity(adapter.transformer, x, sigma, cond, guidance=False)
    v_u = adapter.velocity(adapter.transformer, x, sigma, uncond, guidance=False)
    v = adapter.velocity(adapter.transformer, x, sigma, cond, guidance=True)
    s = adapter.cfg.guidance_scale
    torch.testing.assert_close(v, v_u + s * (v_c - v_u), atol=1e-5, rtol=1e-5)
    assert (v - v_c).abs().max() > 1e-3


def test_flux_guidance_is_an_embedding_not_cfg():
    adapter = make("flux")
    cond = adapter.encode_prompts(PROMPTS[:2])
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.3])
    v = adapter.velocity(adapter.transformer, x, sigma, cond, guidance=True)
    torch.testing.assert_close(adapter.velocity(adapter.transformer, x, sigma, cond, guidance=False), v)
    adapter.cfg.guidance_scale = 1.0
    assert (adapter.velocity(adapter.transformer, x, sigma, cond) - v).abs().max() > 1e-4


def _one_pipeline_step(adapter, cond, x):
    """Run the real pipeline for one step from ``x``; return (output, sigma used, timestep/1000).

    FlowMatchEuler (flux, sd3) steps x - sigma * v from sigma=1. DPM-Solver++ and UniPC
    with flow sigmas reach 0 in one first-order step too, x0 = x - sigma * v, but feed the
    transformer the integer-rounded timestep."""
    t, f, h = cond.tensors, adapter.family, adapter.cfg.height
    common = dict(
        latents=x,
        num_inference_steps=1,
        guidance_scale=adapter.cfg.guidance_scale,
        height=h,
        width=h,
        output_type="latent",
        prompt_embeds=t["prompt_embeds"],
    )
    if f in ("flux", "sd3"):
        extra = {k: v for k, v in t.items() if k != "prompt_embeds"}
        return adapter.pipe(**common, **extra).images, 1.0, 1.0
    scheduler = type(adapter.pipe.scheduler).from_config(adapter.pipe.scheduler.config)
    scheduler.set_timesteps(1)
    sig, tstep = float(scheduler.sigmas[0]), float(scheduler.timesteps[0]) / 1000
    if f == "sana":
        out = adapter.pipe(
            **common,
            negative_prompt=None,
            prompt_attention_mask=t["prompt_attention_mask"],
            negative_prompt_embeds=t["negative_prompt_embeds"],
            negative_prompt_attention_mask=t["negative_prompt_attention_mask"],
            use_resolution_binning=False,
        ).images
    else:
        out = adapter.pipe(
            **common, negative_prompt_embeds=t["negative_prompt_embeds"], num_frames=adapter.cfg.num_frames
        ).frames
    return out, sig, tstep


@pytest.mark.parametrize("family", FAMILIES)
def test_velocity_matches_one_step_of_the_real_pipeline(family):
    """Timestep scaling, guidance and latent layout agree with diffusers' own sampler."""
    adapter = make(family)
    cond = adapter.encode_prompts(PROMPTS[:2])
    x = noise(adapter, 2, seed=3)
    out, sig, tstep = _one_pipeline_step(adapter, cond, x)
    v = adapter.velocity(adapter.transformer, x, torch.full((2,), tstep), cond)
    torch.testing.assert_close(out.float(), x - sig * v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_weights_give_fp32_velocity(family):
    adapter = make(family, dtype="bfloat16")
    assert adapter.transformer.dtype == torch.bfloat16
    cond = adapter.encode_prompts(PROMPTS[:2])
    v = adapter.velocity(adapter.transformer, noise(adapter, 2), torch.tensor([0.7, 0.2]), cond)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


# ----------------------------------------------------------------------------- loading errors


def test_torch_dtype_names():
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="float16"):
        torch_dtype("fp8")


@pytest.mark.parametrize("family", LOADED_FAMILIES)
def test_from_pretrained_missing_local_path(family, tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelLoadError) as err:
        build_adapter(make_cfg(family, pretrained=str(missing)))
    assert str(missing) in str(err.value) and "local" in str(err.value)
    assert "model.pretrained" in str(err.value)

    (tmp_path / "not_a_pipeline").mkdir()
    with pytest.raises(ModelLoadError, match="model_index.json"):
        build_adapter(make_cfg(family, pretrained=str(tmp_path / "not_a_pipeline")))


@pytest.mark.parametrize("family", LOADED_FAMILIES)
def test_from_pretrained_fake_hub_id_offline(family):
    name = "diffrl-tests/no-such-model"
    with pytest.raises(ModelLoadError) as err:
        build_adapter(make_cfg(family, pretrained=name))
    message = str(err.value)
    assert name in message and "local" in message and "hf download" in message


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_local_directory(family, tmp_path):
    """The happy path: a saved diffusers directory loads, frozen, with the same velocity."""
    tiny_twin = make(family)
    tiny_twin.pipe.save_pretrained(tmp_path)
    loaded = make(family, pretrained=str(tmp_path))
    assert type(loaded.pipe) is type(tiny_twin.pipe)
    assert not loaded.transformer.training and not any(
        p.requires_grad for p in loaded.transformer.parameters()
    )
    x, sigma = noise(tiny_twin, 1), torch.tensor([0.6])
    v_ref = tiny_twin.velocity(tiny_twin.transformer, x, sigma, tiny_twin.encode_prompts(PROMPTS[:1]))
    v = loaded.velocity(loaded.transformer, x, sigma, loaded.encode_prompts(PROMPTS[:1]))
    torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_round_trip_through_load_lora_weights(family, tmp_path):
    """Trained LoRA -> adapter.save_lora -> fresh pipeline.load_lora_weights gives the same velocity.

    alpha != rank on purpose: diffusers reloads with alpha == rank unless the LoraConfig
    is saved as metadata."""
    adapter = make(family)
    cond = adapter.encode_prompts(PROMPTS[:2])
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.4])
    base = adapter.velocity(adapter.transformer, x, sigma, cond)

    add_random_lora(adapter)
    tuned = adapter.velocity(adapter.transformer, x, sigma, cond)
    assert (tuned - base).abs().max() > 1e-3

    state = lora_state(adapter)
    adapter.save_lora(tmp_path, state)
    fresh = make(family)
    fresh.pipe.load_lora_weights(tmp_path)
    reloaded = fresh.velocity(fresh.transformer, x, sigma, fresh.encode_prompts(PROMPTS[:2]))
    torch.testing.assert_close(reloaded, tuned, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- family facts


@pytest.mark.parametrize("arch", ["flux1-dev", "sd35-medium", "sana1.5-1.6b"])
def test_family_latent_facts_match_the_published_vae(arch):
    """The run plan's latent layout comes from the adapter class; it must be the real
    VAE's (channels, and 2^(levels - 1) downsampling), not a tiny twin's."""
    import json
    from pathlib import Path

    spec = json.loads((Path(__file__).resolve().parents[2] / "assets" / "arch" / f"{arch}.json").read_text())
    cls = adapter_class(spec["family"])
    vae = spec["vae"]
    levels = len(vae.get("block_out_channels") or vae["encoder_block_out_channels"])
    assert (cls.latent_channels, cls.spatial_downsample) == (vae["latent_channels"], 2 ** (levels - 1))


def test_toy_facts_are_its_pixels_and_wan_counts_latent_frames():
    toy = make("toy")
    assert type(toy).latent_numel(toy.cfg) == math.prod(toy.latent_shape())  # 3 x 32 x 32: no VAE
    wan = make("wan")  # 5 frames -> (5 - 1) // 4 + 1 = 2 latent frames, as its tiny VAE gives
    assert wan.latent_shape()[1] == (wan.cfg.num_frames - 1) // type(wan).temporal_downsample + 1
    assert [adapter_class(f).cfg_as_batch for f in ("flux", "sd3")] == [False, True]
    assert adapter_class("wan").is_video_family() and not adapter_class("sd3").is_video_family()


def test_run_plan_sizes_toy_trajectories_from_its_pixels():
    from diffrl.config import load_config
    from diffrl.training.plan import latent_numel

    assert latent_numel(load_config("toy_flowgrpo")) == 3 * 32 * 32  # was 16 x 4 x 4, 12x too low
