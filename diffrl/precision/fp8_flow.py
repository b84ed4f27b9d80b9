"""Jet-RL's unified precision flow (arXiv 2601.14243): the rollouts and the training
forward run the policy's own linear layers through one FP8 quantizer, so the policy that
sampled a trajectory is exactly the one the update scores.

The policy's weight layers are patched **in place** (no copy): each ``nn.Linear`` and
1x1 ``nn.Conv2d`` (the layers Sol-RL's exploration copy quantizes, minus the family's
keep-high list) computes

    y = Q_a(x) @ Q_w(W_eff)^T + b,     W_eff = W + sum_adapters scale * B @ A,

with W_eff formed from the live (fp32 master) weights at every forward, so LoRA and full
fine-tuning both train through the quantizer and no sync is needed. Gradients are
straight-through (dQ(u)/du = 1); the two backward GEMMs take FP8 operands too, as
Jet-RL's flow does (input gradient Q_g(g) @ Q_w(W), weight gradient Q_g(g)^T @ Q_a(x)),
and what flows between operators stays in the autocast precision.

A switch says when the quantizer is on (:meth:`Fp8Flow.phase`):

* ``precision: {rollout: fp8, train: fp8}`` -- the **unified** flow: on for rollouts and
  for the update's forwards (the policy, its LoRA-disabled reference and the anchor);
* ``precision: {rollout: fp8, train: bf16}`` -- the **naive split**: FP8 rollouts, a
  BF16 update on them; the log-probs stored at sampling come from another policy than
  the one the update scores (Jet-RL's off-policy failure);
* evaluation is always in the model's precision (the quantizer is off).

Two backends compute the same casts: ``reference`` (pure PyTorch, any device; the
formats of :func:`~diffrl.precision.formats.fake_fp8_cast`) and ``torchao`` (its float8
training GEMM ``matmul_with_hp_or_float8_args``, the function ``Float8Linear`` calls,
real FP8 tensor-core GEMMs on Ada / Hopper). ``scaling`` is torchao's recipe name:

* ``rowwise``: one scale per token (activation row) and per output row of the weight,
  powers of two, E4M3 throughout. A sample's numerics do not depend on its batch, so a
  replay in a different micro-batch is exact: the on-policy property holds to float
  tolerance (tests/precision/test_fp8_flow.py).
* ``tensorwise``: one scale per tensor (E5M2 gradients). Faster, but an activation's
  scale is the whole batch's amax, so a rollout batch of 128 and a training micro-batch
  of 64 quantize the same sample differently: the ratio is no longer exactly 1.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from diffrl.precision.exploration import _is_lora_layer, is_pointwise_conv, is_quantizable, with_lora_deltas
from diffrl.precision.formats import fake_fp8_cast, fp8_codes
from diffrl.precision.keep_high import split_keep_high

SCALINGS = ("rowwise", "tensorwise")
BACKENDS = ("reference", "torchao")
PHASES = ("rollout", "train")


def effective_weight(module: nn.Module) -> torch.Tensor:
    """W + every active LoRA delta, **with** its graph (the update trains through it),
    as (out, in): a 1x1 conv's (out, in, 1, 1) weight is viewed as a linear's."""
    weight = with_lora_deltas(module)
    return weight.reshape(weight.shape[0], -1)


def _cast_args(scaling: str, role: str) -> tuple[bool, str, bool]:
    """(rowwise, format, power-of-two scale) of torchao's recipe ``scaling`` for an
    operand ``role``: ``act`` / ``weight`` (E4M3) or ``grad`` (E4M3 row-wise, E5M2
    tensor-wise)."""
    rowwise = scaling == "rowwise"
    fmt = "e5m2" if role == "grad" and not rowwise else "e4m3"
    return rowwise, fmt, rowwise


class _ReferenceFp8Matmul(torch.autograd.Function):
    """y = Q_a(x) @ Q_w(w)^T for 2-D x (tokens, in) and w (out, in), in fp32; backward
    straight-through with FP8 gradient GEMMs: dx = Q_g(g) @ Q_w(w), dw = Q_g(g)^T @ Q_a(x).
    What it keeps for the backward is the FP8 codes and their scales (one byte a value),
    as a real FP8 training GEMM keeps its casts.

    (torchao re-scales each operand along its GEMM's reduction axis in the backward; the
    reference reuses the forward's casts: the forward, which decides the on-policy
    property, is the same, the gradients agree to FP8 rounding.)"""

    @staticmethod
    def forward(ctx, x, w, scaling):
        cx, sx = fp8_codes(x, *_cast_args(scaling, "act"))
        cw, sw = fp8_codes(w, *_cast_args(scaling, "weight"))
        ctx.save_for_backward(cx, sx, cw, sw)
        ctx.scaling, ctx.dtypes = scaling, (x.dtype, w.dtype)
        return (cx.float() / sx) @ (cw.float() / sw).t()

    @staticmethod
    def backward(ctx, g):
        cx, sx, cw, sw = ctx.saved_tensors
        qg = fake_fp8_cast(g, *_cast_args(ctx.scaling, "grad"))
        grad_x = (qg @ (cw.float() / sw)).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        grad_w = (qg.t() @ (cx.float() / sx)).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def _torchao_matmul(scaling: str):
    """torchao's float8 training GEMM for ``scaling`` (its recipe of that name)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    config = Float8LinearConfig.from_recipe_name(scaling)
    # the GEMM settings a Float8Linear of this config would use (emulation off, accumulation)
    mm_config = Float8Linear.from_float(nn.Linear(16, 16, device="meta"), config=config).linear_mm_config

    def matmul(x, w):
        return matmul_with_hp_or_float8_args.apply(x, w.t(), mm_config, config)

    return matmul


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What the layer's output would be in without the quantizer: the autocast dtype
    where autocast is on for x's device, else x's own."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def flow_layer_names(root: nn.Module) -> list[str]:
    """The layers the flow can quantize: every quantizable layer (linear, 1x1 conv) and
    every LoRA wrapper around one; never what is inside a wrapper (its base layer and its
    A / B factors are in the wrapper's patched forward)."""
    names, inside = [], ()
    for name, module in root.named_modules():
        if inside and name.startswith(inside):
            continue
        wrapped = _is_lora_layer(module)
        if wrapped:
            inside = (*inside, name + ".")
        if is_quantizable(module.base_layer if wrapped else module):
            names.append(name)
    return names


def quantized_layers(root: nn.Module, keep_high) -> tuple[list[str], list[str]]:
    """(quantized, kept high): the flow's layers of ``root`` split by the keep-high regexes."""
    return split_keep_high(flow_layer_names(root), keep_high)


def flow_keep_high(precision_cfg, family: str) -> tuple[str, ...]:
    """``precision.keep_high``, or the family's list (the layers Sol-RL's copy keeps high)."""
    from diffrl.precision.keep_high import default_keep_high

    return (
        tuple(precision_cfg.keep_high) if precision_cfg.keep_high is not None else default_keep_high(family)
    )


class Fp8Flow:
    """Patches ``transformer``'s weight layers to run through one FP8 quantizer while a
    phase it covers is active. ``rollout`` / ``train``: whether each phase is quantized."""

    def __init__(
        self, transformer, rollout: bool, train: bool, scaling="rowwise", backend="reference", keep_high=()
    ):
        if scaling not in SCALINGS or backend not in BACKENDS:
            raise ValueError(f"precision.scaling must be one of {SCALINGS} and backend one of {BACKENDS}")
        self.quantized_phases = {p for p, on in zip(PHASES, (rollout, train)) if on}
        self.scaling, self.backend = scaling, backend
        self._matmul = _torchao_matmul(scaling) if backend == "torchao" else self._reference
        self.active = False
        self.keep_high = tuple(keep_high)
        self.quantized, self.kept = self.patch(transformer)

    def patch(self, root: nn.Module) -> tuple[list[str], list[str]]:
        """Patch ``root``'s layers to this flow's switch; (quantized, kept) names. A full
        fine-tune's frozen reference copy is patched too, so the KL compares policies of one
        precision."""
        quantized, kept = quantized_layers(root, self.keep_high)
        for name in quantized:
            self._patch(root.get_submodule(name))
        return quantized, kept

    def _reference(self, x, w):
        return _ReferenceFp8Matmul.apply(x, w, self.scaling)

    def _patch(self, module: nn.Module) -> None:
        original = module.forward
        base = module.base_layer if _is_lora_layer(module) else module
        conv = is_pointwise_conv(base)
        if (
            _is_lora_layer(module)
            and module.lora_dropout
            and any(not isinstance(d, nn.Identity) for d in module.lora_dropout.values())
        ):
            raise ValueError("the FP8 precision flow merges LoRA into the weight: set model.lora.dropout 0")

        def forward(x, *args, **kwargs):
            if not self.active:
                return original(x, *args, **kwargs)
            return self._quantized_linear(module, base, x, conv)

        module.forward = forward

    def _quantized_linear(self, module, base, x, conv: bool) -> torch.Tensor:
        dtype = _compute_dtype(x)
        if conv:  # channels last: the quantizer's rows are pixels, as a linear's are tokens
            x = x.movedim(1, -1)
        shape = x.shape
        weight = effective_weight(module)
        y = self._matmul(x.reshape(-1, shape[-1]).to(dtype), weight)
        y = y.reshape(*shape[:-1], -1).to(dtype)
        if base.bias is not None:
            y = y + base.bias.to(dtype)
        return y.movedim(-1, 1) if conv else y

    @contextlib.contextmanager
    def phase(self, name: str):
        """Run a block of ``name`` (``rollout`` or ``train``) with the quantizer on if the
        flow quantizes that phase; evaluation never enters one (model precision)."""
        if name not in PHASES:
            raise ValueError(f"unknown phase '{name}'; valid: {PHASES}")
        before, self.active = self.active, name in self.quantized_phases
        try:
            yield
        finally:
            self.active = before

    @property
    def unified(self) -> bool:
        return self.quantized_phases == set(PHASES)


def choose_flow_backend(requested: str, hw: dict | None = None) -> str:
    """``auto``: torchao where FP8 GEMMs run (Ada, Hopper, Blackwell) and it is installed,
    else the reference casts."""
    if requested != "auto":
        return requested
    from diffrl.precision.backends import detect_hardware

    hw = detect_hardware() if hw is None else hw
    return "torchao" if hw["has_fp8"] and hw["torchao"] else "reference"


def build_precision_flow(
    precision_cfg, family: str, transformer, log=print, reference=None
) -> Fp8Flow | None:
    """The run's :class:`Fp8Flow` (``precision`` config section) on ``transformer`` and a
    full fine-tune's frozen ``reference``, or None when rollouts and training are both in
    the model's precision."""
    p = precision_cfg
    if "fp8" not in (p.rollout, p.train):
        return None
    backend = choose_flow_backend(p.backend)
    keep = flow_keep_high(p, family)
    flow = Fp8Flow(transformer, p.rollout == "fp8", p.train == "fp8", p.scaling, backend, keep)
    if reference is not None:
        flow.patch(reference)
    kind = "unified (rollouts and training forward)" if flow.unified else "naive split (rollouts only)"
    log(
        f"precision: FP8 {kind}, {p.scaling} scaling, {backend} backend; "
        f"{len(flow.quantized)} layers quantized, {len(flow.kept)} kept high"
    )
    return flow
