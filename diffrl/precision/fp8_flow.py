"""Jet-RL's unified precision flow (arXiv 2601.14243): the rollouts and the training
forward run the policy's own linear layers through one FP8 quantizer, so the policy that
sampled a trajectory is exactly the one the update scores.

The policy's weight layers are patched **in place** (no copy): each ``nn.Linear`` and
1x1 ``nn.Conv2d`` (the layers Sol-RL's exploration copy quantizes, minus the family's
keep-high list) computes

    y = Q_a(x) @ Q_w(W_eff)^T + b,     W_eff = W + sum_adapters scale * B @ A,

with W_eff merged in fp32 from the live master weights (autocast off: the one merge of
:func:`~diffrl.precision.exploration.with_lora_deltas`, Sol-RL's copy's too), so LoRA and
full fine-tuning both train through the quantizer and no sync is needed. In a rollout
phase the weights do not move, and each layer's W_eff is merged and cast once when the
phase starts (:meth:`Fp8Flow.phase`). Gradients are straight-through (dQ(u)/du = 1); the
two backward GEMMs take FP8 operands too, as Jet-RL's flow does (input gradient
Q_g(g) @ Q_w(W), weight gradient Q_g(g)^T @ Q_a(x): with LoRA a full-size GEMM a plain LoRA
backward skips, counted by the FLOP estimate), and what flows between operators stays in
the autocast precision.

A switch says when the quantizer is on (:meth:`Fp8Flow.phase`):

* ``precision: {rollout: fp8, train: fp8}`` -- the **unified** flow: on for rollouts and
  for the update's forwards (the policy, its LoRA-disabled reference and the anchor);
* ``precision: {rollout: fp8, train: bf16}`` -- the **naive split**: FP8 rollouts, a
  BF16 update on them; the log-probs stored at sampling come from another policy than
  the one the update scores (Jet-RL's off-policy failure);
* evaluation is always in the model's precision (the quantizer is off).

Two backends compute the same casts: ``reference`` (pure PyTorch, any device:
:class:`ReferenceGemm`) and ``torchao`` (its float8 training GEMM, real FP8 tensor-core
GEMMs on Ada / Hopper, through :mod:`diffrl.precision.torchao_fp8` for the versions it is
tested with; blockwise through its prototype Triton GEMM, Hopper only). ``scaling``:

* ``rowwise``: one scale per token (activation row) and per output row of the weight,
  powers of two, E4M3 throughout. A sample's numerics do not depend on its batch, so a
  replay in a different micro-batch is exact: the on-policy property holds to float
  tolerance (tests/precision/test_fp8_flow.py), also with compiled rollouts under
  autocast given ``perf.exact_replay`` (tests/training/test_exact_replay.py).
* ``blockwise``: DeepSeek-V3's tiles (arXiv 2412.19437, 3.3.2), Jet-RL's granularity:
  1 x 128 for activations and gradients, 128 x 128 for weights
  (:func:`~diffrl.precision.formats.fp8_tile_codes`); batch-independent too.
* ``tensorwise``: one scale per tensor (E5M2 gradients). Faster, but an activation's
  scale is the whole batch's amax, so a rollout batch of 128 and a training micro-batch
  of 64 quantize the same sample differently: the ratio is no longer exactly 1.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from diffrl.precision.exploration import _is_lora_layer, is_pointwise_conv, is_quantizable, with_lora_deltas
from diffrl.precision.formats import FP8_TILE, fp8_codes, fp8_tile_codes
from diffrl.precision.keep_high import split_keep_high
from diffrl.schema import ConfigError

SCALINGS = ("rowwise", "tensorwise", "blockwise")
BACKENDS = ("reference", "torchao")
PHASES = ("rollout", "train")


def effective_weight(module: nn.Module) -> torch.Tensor:
    """W + every active LoRA delta, merged in fp32 (:func:`with_lora_deltas`) **with** its
    graph (the update trains through it), as (out, in): a 1x1 conv's (out, in, 1, 1)
    weight is viewed as a linear's."""
    weight = with_lora_deltas(module)
    return weight.reshape(weight.shape[0], -1)


def _cast_args(scaling: str, role: str) -> tuple[bool, str, bool]:
    """(rowwise, format, power-of-two scale) of torchao's recipe ``scaling`` for an
    operand ``role``: ``act`` / ``weight`` (E4M3) or ``grad`` (E4M3 row-wise, E5M2
    tensor-wise)."""
    rowwise = scaling == "rowwise"
    fmt = "e5m2" if role == "grad" and not rowwise else "e4m3"
    return rowwise, fmt, rowwise


def operand_codes(x: torch.Tensor, scaling: str, role: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of a 2-D GEMM operand as ``scaling`` casts it: torchao's row-wise or
    tensor-wise recipe (:func:`fp8_codes`), or ``blockwise`` tiles, 1 x 128 for activations
    and gradients and 128 x 128 for weights (:func:`fp8_tile_codes`). The value is
    ``codes.float() / scale``."""
    if scaling == "blockwise":
        tile = (FP8_TILE, FP8_TILE) if role == "weight" else (1, FP8_TILE)
        return fp8_tile_codes(x, tile)
    return fp8_codes(x, *_cast_args(scaling, role))


def operand_cast(x: torch.Tensor, scaling: str, role: str) -> torch.Tensor:
    """An operand quantize-dequantized as :func:`operand_codes` casts it, as fp32."""
    codes, scale = operand_codes(x, scaling, role)
    return codes.float() / scale


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
        cx, sx = operand_codes(x, scaling, "act")
        cw, sw = operand_codes(w, scaling, "weight")
        ctx.save_for_backward(cx, sx, cw, sw)
        ctx.scaling, ctx.dtypes = scaling, (x.dtype, w.dtype)
        return (cx.float() / sx) @ (cw.float() / sw).t()

    @staticmethod
    def backward(ctx, g):
        cx, sx, cw, sw = ctx.saved_tensors
        qg = operand_cast(g, ctx.scaling, "grad")
        grad_x = (qg @ (cw.float() / sw)).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        grad_w = (qg.t() @ (cx.float() / sx)).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class ReferenceGemm:
    """The flow's GEMM in pure PyTorch (any device): ``matmul(x, w)`` with gradients;
    ``cast_weight(w)`` casts a weight once and ``matmul_cast(x, cast)`` uses it, computing
    exactly what ``matmul``'s forward computes (the same casts, the same product)."""

    def __init__(self, scaling: str):
        self.scaling = scaling

    def matmul(self, x, w):
        return _ReferenceFp8Matmul.apply(x, w, self.scaling)

    def cast_weight(self, w):
        return operand_codes(w, self.scaling, "weight")

    def matmul_cast(self, x, w_cast):
        cx, sx = operand_codes(x, self.scaling, "act")
        cw, sw = w_cast
        return (cx.float() / sx) @ (cw.float() / sw).t()


class TorchaoBlockwiseGemm:
    """torchao's prototype blockwise FP8 training GEMM (``Float8BlockwiseLinear``'s
    autograd function: 1 x 128 activations and gradients, 128 x 128 weights, Triton
    kernels on Hopper and newer). Not run on this project's CPU machines: the casts it
    computes are the reference's ``blockwise`` casts, tested against torchao's own PyTorch
    versions of them. No weight cache (its function casts inside)."""

    def __init__(self):
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        self._mm = fp8_blockwise_mm

    def matmul(self, x, w):
        out = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        return self._mm.apply(x.contiguous(), w.contiguous(), FP8_TILE, out, True)

    cast_weight = None


def make_gemm(scaling: str, backend: str):
    """The GEMM of ``backend`` for ``scaling``."""
    if backend == "reference":
        return ReferenceGemm(scaling)
    if scaling == "blockwise":
        return TorchaoBlockwiseGemm()
    from diffrl.precision.torchao_fp8 import TorchaoFloat8

    return TorchaoFloat8(scaling)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What the layer's output would be in without the quantizer: the autocast dtype
    where autocast is on for x's device, else x's own."""
    kind = x.device.type
    if kind != "meta" and torch.is_autocast_enabled(kind):  # meta: the FLOP count's device
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
    phase it covers is active. ``rollout`` / ``train``: whether each phase is quantized.

    In a quantized rollout phase the weights do not change, so each layer's merged,
    quantized weight is cast once when the phase starts and reused by every forward of
    it (the same casts the training forward makes from the same weights: bit-identical),
    instead of being re-merged and re-quantized at every forward (issue 61: 70-80 GB of
    memory traffic per FLUX forward). The casts are dropped when the phase ends. Under
    FSDP, where a layer's weight is whole only inside its block's forward, every forward
    casts as before."""

    def __init__(
        self, transformer, rollout: bool, train: bool, scaling="rowwise", backend="reference", keep_high=()
    ):
        if scaling not in SCALINGS or backend not in BACKENDS:
            raise ValueError(f"precision.scaling must be one of {SCALINGS} and backend one of {BACKENDS}")
        self.quantized_phases = {p for p, on in zip(PHASES, (rollout, train)) if on}
        self.scaling, self.backend = scaling, backend
        self.gemm = make_gemm(scaling, backend)
        self.active = False
        self.keep_high = tuple(keep_high)
        self._layers: list[nn.Module] = []
        self.weight_casts = 0  # weights cast for rollout phases, all phases together
        self.quantized, self.kept = self.patch(transformer)

    def patch(self, root: nn.Module) -> tuple[list[str], list[str]]:
        """Patch ``root``'s layers to this flow's switch; (quantized, kept) names. A full
        fine-tune's frozen reference copy is patched too, so the KL compares policies of one
        precision."""
        quantized, kept = quantized_layers(root, self.keep_high)
        for name in quantized:
            self._patch(root.get_submodule(name))
        return quantized, kept

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
        module._fp8_weight_cast = None
        self._layers.append(module)

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
        rows = x.reshape(-1, shape[-1]).to(dtype)
        cast = module._fp8_weight_cast
        if cast is not None and not torch.is_grad_enabled():
            y = self.gemm.matmul_cast(rows, cast)
        else:
            y = self.gemm.matmul(rows, effective_weight(module))
        y = y.reshape(*shape[:-1], -1).to(dtype)
        if base.bias is not None:
            y = y + base.bias.to(dtype)
        return y.movedim(-1, 1) if conv else y

    def _cast_weights(self) -> None:
        if self.gemm.cast_weight is None:
            return
        with torch.no_grad():
            for module in self._layers:
                base = module.base_layer if _is_lora_layer(module) else module
                if isinstance(base.weight, DTensor):  # FSDP: a shard here, whole only in the forward
                    continue
                module._fp8_weight_cast = self.gemm.cast_weight(effective_weight(module))
                self.weight_casts += 1

    def _drop_weight_casts(self) -> None:
        for module in self._layers:
            module._fp8_weight_cast = None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Run a block of ``name`` (``rollout`` or ``train``) with the quantizer on if the
        flow quantizes that phase; evaluation never enters one (model precision). A
        quantized rollout phase casts the weights once at its start."""
        if name not in PHASES:
            raise ValueError(f"unknown phase '{name}'; valid: {PHASES}")
        before, self.active = self.active, name in self.quantized_phases
        cached = self.active and name == "rollout"
        if cached:
            self._cast_weights()
        try:
            yield
        finally:
            self.active = before
            if cached:
                self._drop_weight_casts()

    @property
    def unified(self) -> bool:
        return self.quantized_phases == set(PHASES)


def choose_flow_backend(requested: str, scaling: str = "rowwise", hw: dict | None = None) -> tuple[str, str]:
    """(backend, why) for the flow. ``auto``: torchao where FP8 GEMMs run (Ada, Hopper,
    Blackwell; blockwise: Hopper and newer, torchao's Triton kernels) and a torchao this
    code is tested with is installed (:func:`~diffrl.precision.torchao_fp8.torchao_problem`),
    else the reference casts, saying why. An explicit ``torchao`` that cannot run here is
    a :class:`~diffrl.schema.ConfigError` naming what is missing."""
    from diffrl.precision.backends import detect_hardware
    from diffrl.precision.torchao_fp8 import torchao_problem

    if requested == "reference":
        return "reference", "requested"
    hw = detect_hardware(probe_imports=False) if hw is None else hw
    needs = (9, 0) if scaling == "blockwise" else (8, 9)
    gpu_ok = hw["cuda"] and tuple(hw["capability"] or (0, 0)) >= needs
    problem = (
        torchao_problem()
        if gpu_ok
        else (f"no GPU with FP8 GEMMs for {scaling} scaling here (sm_{needs[0]}{needs[1]} or newer)")
    )
    if problem is None:
        return "torchao", "requested" if requested == "torchao" else "auto: FP8 GEMMs through torchao"
    if requested == "torchao":
        raise ConfigError(
            f"precision.backend: torchao cannot run: {problem}; or set precision.backend: reference"
        )
    return "reference", f"auto: {problem}; the reference casts (numerics, no speed-up)"


def build_precision_flow(
    precision_cfg, family: str, transformer, log=print, reference=None
) -> Fp8Flow | None:
    """The run's :class:`Fp8Flow` (``precision`` config section) on ``transformer`` and a
    full fine-tune's frozen ``reference``, or None when rollouts and training are both in
    the model's precision."""
    p = precision_cfg
    if "fp8" not in (p.rollout, p.train):
        return None
    backend, why = choose_flow_backend(p.backend, p.scaling)
    keep = flow_keep_high(p, family)
    flow = Fp8Flow(transformer, p.rollout == "fp8", p.train == "fp8", p.scaling, backend, keep)
    if reference is not None:
        flow.patch(reference)
    kind = "unified (rollouts and training forward)" if flow.unified else "naive split (rollouts only)"
    log(
        f"precision: FP8 {kind}, {p.scaling} scaling, {backend} backend ({why}); "
        f"{len(flow.quantized)} layers quantized, {len(flow.kept)} kept high"
    )
    return flow
