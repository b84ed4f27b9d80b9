"""Which layers of each model family stay in high precision: in the exploration copy, and
in the FP8 precision flow.

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
Each family's list is a fact of its adapter (``FlowAdapter.keep_high``, next to the
model it describes: ``diffrl/models/flux.py``...) and is checked against the module names
of that family's tiny twin (the same diffusers classes), so a pattern that matches
nothing fails a test.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def default_keep_high(family: str) -> tuple[str, ...]:
    """The anchored keep-high regexes of ``family``: a fact of its adapter class
    (``FlowAdapter.keep_high``: each family module's ``KEEP_HIGH``)."""
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
