"""Full-size architectures from the published configs in assets/arch, with random
weights (``model.pretrained: random:<arch>``): sizes match the model cards, the meta
device builds them without allocating, and materialised weights give finite outputs."""

import json

import pytest
import torch

from diffrl.config import ConfigError, load_config
from diffrl.models import ModelLoadError, build_adapter
from diffrl.models.arch import ARCH_DIR, _empty_parameters, arch_for, available_archs, load_arch, materialize
from diffrl.twin import full_size_overrides

ARCHS = [
    "flux1-dev",
    "flux1-kontext-dev",
    "flux1-schnell",
    "flux2-klein-4b",
    "qwen-image",
    "qwen-image-edit",
    "sana1.5-1.6b",
    "sd35-large",
    "sd35-medium",
    "wan2.1-t2v-1.3b",
    "wan2.2-t2v-a14b",
]


def test_every_arch_file_is_listed_and_names_itself():
    assert available_archs() == ARCHS
    for name in ARCHS:
        assert json.loads((ARCH_DIR / f"{name}.json").read_text())["name"] == name


@pytest.mark.parametrize("name", ARCHS)
def test_transformer_size_matches_the_model_card(name):
    arch = load_arch(name)
    model = arch.build_transformer()
    params = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    # model cards round (SD3.5 Medium's "2.5B" counts more than the diffusers transformer)
    assert abs(params / arch.published_params - 1) < 0.12, params


def test_flux_dev_has_exactly_its_published_parameter_count():
    # 11,901,408,320: the parameter count of black-forest-labs/FLUX.1-dev's transformer
    assert sum(p.numel() for p in load_arch("flux1-dev").build_transformer().parameters()) == 11_901_408_320


def test_flux_schnell_is_flux_dev_without_the_guidance_embedding():
    dev = load_arch("flux1-dev").build_transformer()
    schnell = load_arch("flux1-schnell").build_transformer()
    guidance = sum(p.numel() for p in dev.time_text_embed.guidance_embedder.parameters())
    assert not hasattr(schnell.time_text_embed, "guidance_embedder")
    assert sum(p.numel() for p in schnell.parameters()) == 11_901_408_320 - guidance


def test_real_configs_resolve_to_their_architecture():
    expected = {
        "flux_flowgrpo": "flux1-dev",
        "flux_branchgrpo": "flux1-dev",
        "flux_solrl": "flux1-dev",
        "flux_schnell_rlcm": "flux1-schnell",
        "sd35_turbo_rlcm": "sd35-large",
        "sd35_flowgrpo": "sd35-medium",
        "sd35_solrl": "sd35-large",
        "sana_solrl": "sana1.5-1.6b",
        "wan_branchgrpo": "wan2.1-t2v-1.3b",
        "wan22_flowgrpo": "wan2.2-t2v-a14b",
        "flux_kontext_flowgrpo": "flux1-kontext-dev",
        "qwenimage_flowgrpo": "qwen-image",
        "flux2_flowgrpo": "flux2-klein-4b",
    }
    for config, arch in expected.items():
        assert arch_for(load_config(config).model.pretrained).name == arch


@pytest.mark.parametrize(
    "config,latent,text",
    [
        ("flux_solrl", (2025, 64), {"prompt_embeds": (512, 4096), "pooled_prompt_embeds": (768,)}),
        ("wan_branchgrpo", (16, 9, 30, 52), {"prompt_embeds": (512, 4096)}),
        ("wan22_flowgrpo", (16, 9, 30, 52), {"prompt_embeds": (512, 4096)}),
        ("qwenimage_flowgrpo", (1024, 64), {"prompt_embeds": (256, 3584)}),
    ],
)
def test_full_size_adapter_runs_on_the_meta_device(config, latent, text):
    cfg = load_config(
        config, [f"model.pretrained=random:{arch_for(load_config(config).model.pretrained).name}"]
    )
    adapter = build_adapter(cfg.model, device="meta")
    assert (
        tuple(adapter.latent_shape()) == latent
    )  # FLUX 720px: (720/16)^2 packed tokens; Wan: 33 frames -> 9
    cond = adapter.encode_prompts(["a cat", "a dog"])
    for key, shape in text.items():
        assert tuple(cond.tensors[key].shape[1:]) == shape and cond.tensors[key].is_meta
    x = torch.zeros((2, *latent), device="meta")
    v = adapter.velocity(adapter.transformer, x, torch.full((2,), 0.5, device="meta"), cond)
    assert v.shape == x.shape and v.is_meta


def test_materialize_gives_finite_weights_and_keeps_computed_buffers():
    from diffusers import SD3Transformer2DModel

    kw = dict(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=32,
        pos_embed_max_size=32,
        qk_norm="rms_norm",
    )
    reference = SD3Transformer2DModel(**kw)
    with _empty_parameters():
        model = SD3Transformer2DModel(**kw)
    materialize(model, "cpu", torch.float32, seed=0)
    assert not any(p.is_meta for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the sin-cos position grid is computed, not random
    assert torch.equal(model.pos_embed.pos_embed, reference.pos_embed.pos_embed)
    # norms without reset_parameters get unit scales
    assert torch.equal(model.transformer_blocks[0].attn.norm_q.weight, torch.ones(16))
    out = model(torch.randn(1, 4, 16, 16), torch.randn(1, 8, 32), torch.randn(1, 32), torch.tensor([500.0]))[
        0
    ]
    assert torch.isfinite(out).all()
    with _empty_parameters():
        again = SD3Transformer2DModel(**kw)
    materialize(again, "cpu", torch.float32, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded


def test_unknown_arch_and_family_mismatch_are_clear_errors():
    with pytest.raises(ModelLoadError, match="shipped architectures: flux1-dev"):
        build_adapter(
            load_config("tiny_flux_flowgrpo", ["model.pretrained=random:flux2"]).model, device="meta"
        )
    with pytest.raises(ModelLoadError, match="set model.family: sana"):
        build_adapter(
            load_config("tiny_flux_flowgrpo", ["model.pretrained=random:sana1.5-1.6b"]).model, device="meta"
        )


def test_full_size_overrides_keep_the_config_and_swap_weights_and_rewards():
    real = load_config("sd35_solrl")
    cfg = load_config("sd35_solrl", full_size_overrides(real))
    assert cfg.model.pretrained == "random:sd35-large"
    assert (cfg.model.height, cfg.model.lora, cfg.rollout, cfg.solrl) == (
        real.model.height,
        real.model.lora,
        real.rollout,
        real.solrl,
    )
    assert {r.name for r in cfg.rewards} <= {"jpeg_compressibility", "jpeg_incompressibility"}
    with pytest.raises(ConfigError, match="no shipped architecture"):
        full_size_overrides(load_config("toy_flowgrpo"))


def test_materialize_keeps_the_classes_fp32_modules_in_fp32():
    from diffusers import WanTransformer3DModel

    model = materialize(load_arch("wan2.1-t2v-1.3b").build_transformer(), "meta", torch.bfloat16)
    keep = WanTransformer3DModel._keep_in_fp32_modules
    assert "time_embedder" in keep
    for name, p in model.named_parameters():
        in_kept = any(k in name.split(".") for k in keep)
        assert p.dtype == (torch.float32 if in_kept else torch.bfloat16), name


def test_full_size_kontext_encodes_its_input_images_with_the_published_vae_on_meta():
    """The text comes from CPU encoders; the input image goes through the full-size VAE on
    the meta device, so its tokens are as many as the target's (512 px: 32 x 32)."""
    from tests.helpers import family_prompts

    cfg = load_config("flux_kontext_flowgrpo", ["model.pretrained=random:flux1-kontext-dev"])
    adapter = build_adapter(cfg.model, device="meta")
    cond = adapter.encode_prompts(family_prompts("flux_kontext", ["make it blue", "remove it"]))
    assert (
        tuple(cond.tensors["image_latents"].shape) == (2, 1024, 64) and cond.tensors["image_latents"].is_meta
    )
    x = torch.zeros((2, 1024, 64), device="meta")
    assert (
        adapter.velocity(adapter.transformer, x, torch.full((2,), 0.5, device="meta"), cond).shape == x.shape
    )
