"""FLUX.1 Kontext on the tiny twin: prompts carry input images, the image enters as
extra tokens, and the velocity is one step of diffusers' own FluxKontextPipeline."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from diffrl.data.prompts import PromptFileError
from rewards.prompts import EditPrompt
from tests.models.lora import add_random_lora, lora_state
from tests.models.test_adapters import make, noise


@pytest.fixture
def images(tmp_path):
    paths = []
    for i, colour in enumerate([(220, 30, 30), (30, 60, 220)]):
        im = Image.new("RGB", (32, 32), (255, 255, 255))
        im.paste(colour, (4 + 8 * i, 6, 20 + 8 * i, 22))
        im.save(tmp_path / f"{i}.png")
        paths.append(tmp_path / f"{i}.png")
    return paths


def kontext(**overrides):
    return make("flux_kontext", guidance_scale=2.5, **overrides)


def test_tiny_twin_is_a_kontext_pipeline_on_flux_classes():
    from diffusers import FluxKontextPipeline, FluxTransformer2DModel

    adapter = kontext()
    assert isinstance(adapter.pipe, FluxKontextPipeline) and adapter.edits_images
    assert (
        isinstance(adapter.transformer, FluxTransformer2DModel) and adapter.transformer.config.guidance_embeds
    )


def test_prompts_need_images_and_each_image_is_its_own_conditioning(images):
    adapter = kontext()
    with pytest.raises(PromptFileError, match="no input image"):
        adapter.encode_prompts(["make the red square blue"])
    a, b = (EditPrompt("make it blue", p) for p in images)
    cond = adapter.encode_prompts([a, b, a])
    latents = cond.tensors["image_latents"]
    assert latents.shape == (3, *adapter.latent_shape())  # same size as the target: one token each
    assert torch.equal(latents[0], latents[2]) and not torch.equal(latents[0], latents[1])
    torch.testing.assert_close(cond.tensors["prompt_embeds"][0], cond.tensors["prompt_embeds"][1])


def test_velocity_matches_one_step_of_the_real_pipeline(images):
    adapter = kontext()
    prompts = [EditPrompt("make it blue", p) for p in images]
    cond = adapter.encode_prompts(prompts)
    x = noise(adapter, 2, seed=3)
    out = adapter.pipe(
        image=[Image.open(p).convert("RGB") for p in images],
        prompt_embeds=cond.tensors["prompt_embeds"],
        pooled_prompt_embeds=cond.tensors["pooled_prompt_embeds"],
        latents=x,
        num_inference_steps=1,
        guidance_scale=2.5,
        height=32,
        width=32,
        output_type="latent",
        _auto_resize=False,
        max_area=32 * 32,  # else the pipeline rescales the output to 1024^2 pixels
    ).images
    v = adapter.velocity(adapter.transformer, x, torch.ones(2), cond)
    torch.testing.assert_close(out.float(), x - v, atol=1e-5, rtol=1e-5)


def test_the_input_image_changes_the_velocity_and_batches_do_not(images):
    adapter = kontext()
    a, b = (EditPrompt("make it blue", p) for p in images)
    x, sigma = noise(adapter, 1).repeat(2, 1, 1), torch.tensor([0.7, 0.7])
    v = adapter.velocity(adapter.transformer, x, sigma, adapter.encode_prompts([a, b]))
    assert (v[0] - v[1]).abs().max() > 1e-4
    alone = adapter.velocity(adapter.transformer, x[:1], sigma[:1], adapter.encode_prompts([a]))
    torch.testing.assert_close(v[:1], alone, atol=1e-5, rtol=1e-5)


def test_lora_round_trip_through_load_lora_weights(images, tmp_path):
    adapter = kontext()
    cond = adapter.encode_prompts([EditPrompt("make it blue", p) for p in images])
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.4])
    add_random_lora(adapter)
    tuned = adapter.velocity(adapter.transformer, x, sigma, cond)
    adapter.save_lora(tmp_path / "lora", lora_state(adapter))
    fresh = kontext()
    fresh.pipe.load_lora_weights(tmp_path / "lora")
    reloaded = fresh.velocity(
        fresh.transformer, x, sigma, fresh.encode_prompts([EditPrompt("make it blue", p) for p in images])
    )
    torch.testing.assert_close(reloaded, tuned, atol=1e-5, rtol=1e-5)


def test_a_source_of_another_size_is_resized_as_the_pipeline_resizes_it(tmp_path):
    """A 48x40 source, resized (Lanczos) to the run's 32x32, and a mid-schedule step: the
    velocity equals the pipeline's second step given the same schedule and image size."""
    adapter = kontext()
    im = Image.new("RGB", (48, 40), (255, 255, 255))
    im.paste((30, 160, 50), (6, 5, 30, 29))
    im.save(tmp_path / "src.png")
    prompt = EditPrompt("make it blue", tmp_path / "src.png")
    cond = adapter.encode_prompts([prompt])
    resized = Image.open(tmp_path / "src.png").convert("RGB").resize((32, 32), Image.Resampling.LANCZOS)
    seen = {}

    def second_step(pipe, i, t, kwargs):
        seen.setdefault(i, kwargs["latents"].clone())
        return kwargs

    x = noise(adapter, 1, seed=5)
    sigmas = [1.0, 0.6]
    out = adapter.pipe(
        image=[resized],
        prompt_embeds=cond.tensors["prompt_embeds"],
        pooled_prompt_embeds=cond.tensors["pooled_prompt_embeds"],
        latents=x,
        sigmas=sigmas,
        num_inference_steps=2,
        guidance_scale=2.5,
        height=32,
        width=32,
        output_type="latent",
        _auto_resize=False,
        max_area=32 * 32,
        callback_on_step_end=second_step,
        callback_on_step_end_tensor_inputs=["latents"],
    ).images
    schedule = type(adapter.pipe.scheduler).from_config(adapter.pipe.scheduler.config)
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    c = schedule.config
    mu = calculate_shift(
        adapter.latent_shape()[0], c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift
    )
    schedule.set_timesteps(sigmas=sigmas, mu=mu)
    s1, s2 = float(schedule.sigmas[1]), float(schedule.sigmas[2])
    v = adapter.velocity(adapter.transformer, seen[0], torch.tensor([s1]), cond)
    torch.testing.assert_close(out.float(), seen[0] + (s2 - s1) * v, atol=1e-5, rtol=1e-5)
