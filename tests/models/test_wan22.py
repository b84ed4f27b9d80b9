"""Wan2.2 A14B's two experts on the tiny twin: the routing rule is the pipeline's own,
each expert gets its own CFG scale, both train, and LoRA round-trips into both."""

from __future__ import annotations

import pytest
import torch

from diffrl.models.wan22 import TwoExperts
from tests.models.lora import add_random_lora, lora_state
from tests.models.test_adapters import PROMPTS, make, noise


def wan22(**overrides):
    return make("wan22", guidance_scale=4.0, guidance_scale_2=3.0, **overrides)


def test_tiny_twin_has_two_distinct_experts_and_the_published_boundary():
    adapter = wan22()
    pipe = adapter.pipe
    assert isinstance(adapter.transformer, TwoExperts)
    assert adapter.transformer.high is pipe.transformer and adapter.transformer.low is pipe.transformer_2
    assert pipe.config.boundary_ratio == 0.875 and adapter.transformer.boundary_timestep == 875.0
    high, low = pipe.transformer.state_dict(), pipe.transformer_2.state_dict()
    assert high.keys() == low.keys() and any(not torch.equal(high[k], low[k]) for k in high)
    assert adapter.is_video_family() and adapter.latent_shape() == (16, 2, 4, 4)


def test_routing_and_timesteps_match_what_the_pipeline_runs():
    """Hooks record which expert the real WanPipeline calls at each step and with what
    timestep; TwoExperts routes the same timesteps the same way, and our sigma grid
    gives the pipeline's timesteps."""
    adapter = wan22()
    pipe, seen = adapter.pipe, []
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args, kwargs, name=name: seen.append((name, float(kwargs["timestep"][0]))),
            with_kwargs=True,
        )
        for name, module in (("high", pipe.transformer), ("low", pipe.transformer_2))
    ]
    cond = adapter.encode_prompts(PROMPTS[:1])
    pipe(
        prompt_embeds=cond.tensors["prompt_embeds"],
        negative_prompt_embeds=cond.tensors["negative_prompt_embeds"],
        latents=noise(adapter, 1),
        num_inference_steps=8,
        guidance_scale=4.0,
        guidance_scale_2=3.0,
        height=32,
        width=32,
        num_frames=5,
        output_type="latent",
    )
    for hook in hooks:
        hook.remove()
    steps = seen[::2]  # cond and uncond forwards
    assert {name for name, _ in steps} == {"high", "low"}
    sigmas = adapter.sigmas(8)[:-1]
    for (name, t), sigma in zip(steps, sigmas):
        assert int(t) == int(sigma.double() * 1000)  # the pipeline truncates our sigma * 1000
        assert bool(adapter.transformer.uses_high(torch.tensor([t]))) == (name == "high")
        assert bool(adapter.transformer.uses_high(sigma[None] * 1000)) == (name == "high")


def test_each_sample_gets_its_experts_velocity_and_cfg_scale():
    """Against the experts called directly: high above the boundary with scale 4, low
    below it with scale 3, in one mixed batch."""
    adapter = wan22()
    cond = adapter.encode_prompts(PROMPTS[:2])
    x, sigma = noise(adapter, 2), torch.tensor([0.95, 0.4])
    v = adapter.velocity(adapter.transformer, x, sigma, cond)
    for i, (expert, scale) in enumerate(((adapter.pipe.transformer, 4.0), (adapter.pipe.transformer_2, 3.0))):

        def raw(key, i=i, expert=expert):
            return expert(
                hidden_states=x[i : i + 1],
                timestep=sigma[i : i + 1] * 1000,
                encoder_hidden_states=cond.tensors[key][i : i + 1],
                return_dict=False,
            )[0]

        expected = raw("negative_prompt_embeds") + scale * (
            raw("prompt_embeds") - raw("negative_prompt_embeds")
        )
        torch.testing.assert_close(v[i : i + 1], expected, atol=1e-5, rtol=1e-5)


def test_velocity_matches_one_step_of_the_real_pipeline():
    adapter = wan22()
    cond = adapter.encode_prompts(PROMPTS[:2])
    x = noise(adapter, 2, seed=3)
    scheduler = type(adapter.pipe.scheduler).from_config(adapter.pipe.scheduler.config)
    scheduler.set_timesteps(1)
    out = adapter.pipe(
        prompt_embeds=cond.tensors["prompt_embeds"],
        negative_prompt_embeds=cond.tensors["negative_prompt_embeds"],
        latents=x,
        num_inference_steps=1,
        guidance_scale=4.0,
        guidance_scale_2=3.0,
        height=32,
        width=32,
        num_frames=5,
        output_type="latent",
    ).frames
    t = float(scheduler.timesteps[0]) / 1000
    v = adapter.velocity(adapter.transformer, x, torch.full((2,), t), cond)
    torch.testing.assert_close(out.float(), x - float(scheduler.sigmas[0]) * v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sigmas", [[0.95, 0.9], [0.3, 0.2], [0.95, 0.2]])
def test_both_experts_get_gradients_whatever_the_batch(sigmas):
    """A batch on one expert still gives the other's trainable weights a (zero) gradient,
    so DDP/FSDP reductions see every weight; real gradients only where the expert ran."""
    adapter = wan22()
    add_random_lora(adapter, targets=["to_q"], rank=2, alpha=2.0)
    cond = adapter.encode_prompts(PROMPTS[:2])
    sigma = torch.tensor(sigmas)
    adapter.velocity(adapter.transformer, noise(adapter, 2), sigma, cond).square().sum().backward()
    used = {"high": bool((sigma * 1000 >= 875).any()), "low": bool((sigma * 1000 < 875).any())}
    for name, p in adapter.transformer.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            assert bool(p.grad.abs().sum() > 0) == used[name.split(".")[0]], name


def test_lora_round_trip_into_both_experts(tmp_path):
    adapter = wan22()
    add_random_lora(adapter)
    cond = adapter.encode_prompts(PROMPTS[:2])
    x, sigma = noise(adapter, 2), torch.tensor([0.95, 0.3])  # one sample per expert
    tuned = adapter.velocity(adapter.transformer, x, sigma, cond)
    adapter.save_lora(tmp_path, lora_state(adapter))

    fresh = wan22()
    base = fresh.velocity(fresh.transformer, x, sigma, fresh.encode_prompts(PROMPTS[:2]))
    assert ((tuned - base).flatten(1).abs().amax(1) > 1e-3).all()  # both experts were changed
    fresh.pipe.load_lora_weights(tmp_path)
    fresh.pipe.load_lora_weights(tmp_path / "transformer_2", load_into_transformer_2=True)
    reloaded = fresh.velocity(fresh.transformer, x, sigma, fresh.encode_prompts(PROMPTS[:2]))
    torch.testing.assert_close(reloaded, tuned, atol=1e-5, rtol=1e-5)


def test_a_one_transformer_pipeline_is_refused_with_the_family_to_use():
    from diffrl.models import ModelLoadError
    from diffrl.models.wan22 import Wan22Adapter

    wan = make("wan")
    with pytest.raises(ModelLoadError, match="use model.family: wan"):
        Wan22Adapter(wan.pipe, wan.cfg)


def test_an_exported_two_expert_lora_loads_back_into_a_policy(tmp_path):
    """Policy.save_pretrained writes the experts' LoRAs apart (diffusers' layout);
    compare.py's loader reads both back into the right expert."""
    from diffrl.config import load_config
    from diffrl.evaluation.compare import load_weights
    from diffrl.models import build_adapter
    from diffrl.models.policy import Policy

    cfg = load_config("tiny_wan22_flowgrpo")
    trained = Policy(build_adapter(cfg.model), cfg.model, seed=0)
    with torch.no_grad():
        for _, p in trained.trainable_named_parameters():
            p.normal_()
    trained.save_pretrained(tmp_path)
    assert (tmp_path / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    fresh = Policy(build_adapter(cfg.model), cfg.model, seed=1)
    load_weights(fresh, tmp_path)
    want, got = dict(trained.trainable_named_parameters()), dict(fresh.trainable_named_parameters())
    assert want.keys() == got.keys() and {n.split(".")[0] for n in want} == {"high", "low"}
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
