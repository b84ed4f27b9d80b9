"""Which layers of each model family stay in high precision in the exploration copy.

Sol-RL explores with a low-precision copy of the policy, and NVFP4 (E2M1 values with
only 8 magnitudes per block of 16, one E4M3 scale per block) is far too coarse for the
few layers whose error is not averaged away:

* **input embedders** (``x_embedder``, patch / pos embed, ``context_embedder``,
  Qwen-Image's ``img_in`` / ``txt_in``): they map latents and text features into the
  residual stream once, and every later layer inherits their error;
* **timestep / guidance / text / caption embedders** and the **adaLN modulation
  linears** (``norm1.linear``, ``norm_out.linear``, SANA's ``time_embed.linear``,
  Wan's ``time_proj``, Qwen-Image's ``img_mod.1`` / ``txt_mod.1``): their outputs are
  *scales and shifts* that multiply every token, so a 4-bit error there is a
  systematic error on the whole image;
* the **final projection** (``proj_out`` at the top level): it writes the velocity
  itself.

Everything else (attention q/k/v/out, feed-forward linears, FLUX's single-block
``proj_mlp`` and ``proj_out``, SANA's 1x1 ``conv_inverted`` / ``conv_point``) is
quantized: that is where the FLOPs are.

Patterns are regexes matched with :func:`re.fullmatch` against qualified module names
from ``named_modules()``; anchoring matters. A loose ``.*proj_out.*`` would also keep
every FLUX ``single_transformer_blocks.N.proj_out`` (a third of FLUX's single-block
compute) in BF16, and a ``conv_in`` substring would match SANA's ``ff.conv_inverted``.
Each list is checked against the module names of that family's tiny twin (the same
diffusers classes), so a pattern that matches nothing fails a test.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# adaLN-Zero modulation of a double-stream block (SD3.5's AdaLayerNormZeroX and the
# last block's AdaLayerNormContinuous context norm also name their linear ``.linear``)
_DOUBLE_BLOCK_MODULATION = r"transformer_blocks\.\d+\.norm1(_context)?\.linear"

SD3 = (
    r"pos_embed\.proj",  # patch embedding conv (2x2; never quantized, listed for intent)
    r"context_embedder",
    r"time_text_embed\..+",  # timestep and pooled-text embedders
    _DOUBLE_BLOCK_MODULATION,
    r"norm_out\.linear",
    r"proj_out",
)  # also the toy model's: it is an SD3Transformer2DModel

FLUX = (
    r"x_embedder",
    r"context_embedder",
    r"time_text_embed\..+",  # timestep, guidance and pooled-text embedders
    _DOUBLE_BLOCK_MODULATION,
    r"single_transformer_blocks\.\d+\.norm\.linear",  # AdaLayerNormZeroSingle
    r"norm_out\.linear",
    r"proj_out",  # top level only: single_transformer_blocks.N.proj_out is quantized
)

SANA = (
    r"patch_embed\.proj",  # a 1x1 conv when patch_size is 1: quantizable, so listed
    r"time_embed\..+",  # AdaLayerNormSingle: timestep embedder + the shared adaLN-single linear
    r"caption_projection\..+",
    r"proj_out",
)

WAN = (
    r"patch_embedding",  # Conv3d (never quantized, listed for intent)
    r"condition_embedder\..+",  # time / text (/ image) embedders and time_proj, the adaLN modulation
    r"proj_out",
)


# Wan2.2 A14B: the same layers in each of its two experts (``high.`` and ``low.``, the
# submodules of ``diffrl.models.wan22.TwoExperts``)
WAN22 = tuple(rf"(high|low)\.{pattern}" for pattern in WAN)

# Qwen-Image (QwenImageTransformer2DModel: text-to-image and edit pipelines alike)
QWENIMAGE = (
    r"img_in",  # latent (packed 2x2 patch) embedder
    r"txt_in",  # Qwen2.5-VL hidden states into the text stream
    r"time_text_embed\..+",  # timestep embedder (linear_1, linear_2)
    r"transformer_blocks\.\d+\.(img|txt)_mod\.1",  # adaLN modulation of both streams
    r"norm_out\.linear",
    r"proj_out",
)

# FLUX.2 (Flux2Transformer2DModel, the klein models): its adaLN modulation is not per
# block but three linears shared by all blocks (each one's output scales every token
# of every block), and its single blocks fuse attention and MLP into
# ``attn.to_qkv_mlp_proj`` / ``attn.to_out``, which are quantized like FLUX.1's
# ``proj_mlp`` / ``proj_out``.
FLUX2 = (
    r"x_embedder",
    r"context_embedder",
    r"time_guidance_embed\..+",  # timestep (and, with guidance_embeds, guidance) embedders
    r"(double_stream_modulation_(img|txt)|single_stream_modulation)\.linear",
    r"norm_out\.linear",
    r"proj_out",  # top level only: single_transformer_blocks.N.attn.to_out is quantized
)


def default_keep_high(family: str) -> tuple[str, ...]:
    """The anchored keep-high regexes of ``family``: a fact of its adapter class
    (``FlowAdapter.keep_high``, set from the tuples above)."""
    from diffrl.models import adapter_class

    return adapter_class(family).keep_high


def compile_patterns(patterns: Iterable[str]) -> list[re.Pattern]:
    """Compile keep-high regexes, naming the pattern that does not compile."""
    if isinstance(patterns, str):
        raise TypeError(f"keep_high must be a list of regexes, not the string '{patterns}'")
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"keep_high pattern '{pattern}' is not a valid regex: {e}") from None
    return compiled


def split_keep_high(names: Iterable[str], patterns: Iterable[str]) -> tuple[list[str], list[str]]:
    """(quantized, kept): ``names`` split by whether a pattern fully matches them."""
    compiled = compile_patterns(patterns)
    quantized, kept = [], []
    for name in names:
        (kept if any(p.fullmatch(name) for p in compiled) else quantized).append(name)
    return quantized, kept
