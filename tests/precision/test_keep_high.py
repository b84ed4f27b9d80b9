"""Per-family keep-high lists on the tiny twins (the same diffusers classes as the real
models): exactly which layers stay high, the anchoring pitfalls (FLUX single-block
proj_out, SANA conv_inverted), and that no pattern is dead."""

import re

import pytest

from diffrl.config import load_config
from diffrl.models import available as available_families
from diffrl.models import build_adapter
from diffrl.precision.exploration import ExplorationCopy
from diffrl.precision.keep_high import default_keep_high, split_keep_high

FAMILIES = available_families()

_CACHE = {}


def _copy(family):
    """A bf16 exploration copy of the family's tiny twin with its default keep-high list."""
    if family not in _CACHE:
        transformer = build_adapter(load_config(f"tiny_{family}_flowgrpo").model).transformer
        _CACHE[family] = (ExplorationCopy(transformer, "bf16", default_keep_high(family)), transformer.config)
    return _CACHE[family]


def _embedders(prefix, names):
    return {f"{prefix}.{n}.linear_{i}" for n in names for i in (1, 2)}


def _sd3_kept(config):
    blocks = range(config.num_layers)
    return (
        {"context_embedder", "norm_out.linear", "proj_out"}
        | _embedders("time_text_embed", ["timestep_embedder", "text_embedder"])
        | {f"transformer_blocks.{b}.{n}.linear" for b in blocks for n in ("norm1", "norm1_context")}
    )


def _expected_kept(family, config):
    if family == "wan22":  # Wan's list in each expert
        return {f"{expert}.{name}" for expert in ("high", "low") for name in _expected_kept("wan", config)}
    if family == "flux2":  # modulation is shared by all blocks: three linears, not one per block
        return {"x_embedder", "context_embedder", "norm_out.linear", "proj_out"} | {
            "time_guidance_embed.timestep_embedder.linear_1",
            "time_guidance_embed.timestep_embedder.linear_2",
            "double_stream_modulation_img.linear",
            "double_stream_modulation_txt.linear",
            "single_stream_modulation.linear",
        }
    if family in ("qwenimage", "qwenimage_edit"):
        return (
            {"img_in", "txt_in", "norm_out.linear", "proj_out"}
            | _embedders("time_text_embed", ["timestep_embedder"])
            | {f"transformer_blocks.{b}.{s}_mod.1" for b in range(config.num_layers) for s in ("img", "txt")}
        )
    if family in ("flux", "flux_kontext"):
        return (
            {"x_embedder", "context_embedder", "norm_out.linear", "proj_out"}
            | _embedders("time_text_embed", ["timestep_embedder", "guidance_embedder", "text_embedder"])
            | {
                f"transformer_blocks.{b}.{n}.linear"
                for b in range(config.num_layers)
                for n in ("norm1", "norm1_context")
            }
            | {f"single_transformer_blocks.{b}.norm.linear" for b in range(config.num_single_layers)}
        )
    if family in ("sd3", "toy"):
        return _sd3_kept(config)
    if family == "sana":
        return (
            {"patch_embed.proj", "time_embed.linear", "proj_out"}
            | _embedders("time_embed.emb", ["timestep_embedder"])
            | {"caption_projection.linear_1", "caption_projection.linear_2"}
        )
    return {"condition_embedder.time_proj", "proj_out"} | _embedders(
        "condition_embedder", ["time_embedder", "text_embedder"]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_exactly_the_embedders_modulation_and_final_projection_stay_high(family):
    copy, config = _copy(family)
    assert set(copy.kept) == _expected_kept(family, config)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_pattern_matches_a_layer_of_the_tiny_twin(family):
    copy, _ = _copy(family)
    dead = [p for p in default_keep_high(family) if not any(re.fullmatch(p, n) for n in copy.layer_names)]
    assert dead == []


def _attention_and_ff(prefix, blocks, attn, ff):
    return {f"{prefix}.{b}.{n}" for b in blocks for n in attn + ff}


def test_flux_single_block_proj_out_is_quantized_and_top_level_kept():
    copy, config = _copy("flux")
    assert re.fullmatch(r".*proj_out.*", "single_transformer_blocks.0.proj_out")  # the pitfall is real
    singles = range(config.num_single_layers)
    must = {
        f"single_transformer_blocks.{b}.{n}"
        for b in singles
        for n in ("proj_out", "proj_mlp", "attn.to_q", "attn.to_k", "attn.to_v")
    }
    must |= _attention_and_ff(
        "transformer_blocks",
        range(config.num_layers),
        [
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
            "attn.to_add_out",
        ],
        ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"],
    )
    assert must <= set(copy.quantized)
    assert "proj_out" in copy.kept and "proj_out" not in copy.quantized


@pytest.mark.parametrize("family", ["sd3", "toy"])
def test_sd3_attention_and_feed_forward_are_quantized(family):
    copy, config = _copy(family)
    blocks = range(config.num_layers)
    must = _attention_and_ff(
        "transformer_blocks",
        blocks,
        [
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
        ],
        ["ff.net.0.proj", "ff.net.2"],
    )
    assert must <= set(copy.quantized)
    assert "pos_embed.proj" not in copy.quantizable  # a 2x2 patch conv: never quantized


def test_sana_pointwise_convs_are_quantized_and_depthwise_conv_is_not():
    copy, config = _copy("sana")
    assert re.search("conv_in", "transformer_blocks.0.ff.conv_inverted")  # the pitfall is real
    blocks = range(config.num_layers)
    attn = [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]
    must = _attention_and_ff("transformer_blocks", blocks, attn, ["ff.conv_inverted", "ff.conv_point"])
    assert must <= set(copy.quantized)
    depthwise = {f"transformer_blocks.{b}.ff.conv_depth" for b in blocks}
    assert depthwise <= set(copy.layer_names) and not depthwise & set(copy.quantizable)
    assert "patch_embed.proj" in copy.quantizable  # a 1x1 conv: kept only by its pattern


def test_wan_attention_and_feed_forward_are_quantized():
    copy, config = _copy("wan")
    attn = [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]
    must = _attention_and_ff("blocks", range(config.num_layers), attn, ["ffn.net.0.proj", "ffn.net.2"])
    assert must <= set(copy.quantized)


def test_unknown_family_names_the_valid_ones():
    valid = ", ".join(sorted(FAMILIES))  # every registered family, sorted
    assert valid.startswith("flux, flux2, flux_kontext, qwenimage")
    with pytest.raises(ValueError, match=f"unknown model family 'sdxl'. Valid model families: {valid}$"):
        default_keep_high("sdxl")


def test_split_is_a_full_match_and_names_a_bad_pattern():
    names = ["proj_out", "blocks.0.proj_out", "x_embedder"]
    assert split_keep_high(names, [r"proj_out"]) == (["blocks.0.proj_out", "x_embedder"], ["proj_out"])
    assert split_keep_high(names, [r"embed"]) == (names, [])  # a substring is not enough
    with pytest.raises(ValueError, match=r"keep_high pattern 'norm\(' is not a valid regex"):
        split_keep_high(names, [r"norm("])
    with pytest.raises(TypeError, match="list of regexes"):
        split_keep_high(names, "proj_out")
