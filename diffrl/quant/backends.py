"""Which code runs the low-precision exploration copy, and why.

* ``reference``: pure-PyTorch fake quantization (:class:`ExplorationCopy`), exact to the
  formats, on any device. Numerics only, no speed-up.
* ``modelopt``: NVIDIA ModelOpt's ``mtq.quantize`` with ``NVFP4_DEFAULT_CFG`` /
  ``FP8_DEFAULT_CFG``. Its NVFP4 quantizers are fake quant (quantize-dequantize) in
  Triton/CUDA kernels, so they need a CUDA GPU; FP4 *tensor cores* exist only on
  Blackwell (sm_100+). On Hopper and older, NVFP4 is simulated: the numerics of NVFP4,
  none of its speed (H100 has no FP4 tensor cores; docs/ALGORITHMS.md section 9). The
  copy (``modelopt_copy.py``) folds its quantized weights once per sync, so a forward
  quantizes activations only.
* ``torchao``: FP8 (E4M3) dynamic activations and weights through
  ``quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))``
  under ``torch.compile``: real FP8 GEMMs (``torch._scaled_mm``) on GPUs with FP8
  tensor cores (sm_89+: Ada, Hopper, Blackwell). That is where Hopper's speed comes from.
  Per-row granularity gives each token its own activation scale and each output row its
  own weight scale, so, as in the reference path, a sample's numerics do not depend on
  the rest of its batch.
* ``none``: the BF16 control.

Every backend quantizes the same layers: ``nn.Linear`` and 1x1 convs, minus the
family's keep-high list. ModelOpt's default configs disable ``*proj_out.*`` by name,
which would keep FLUX's single-block ``proj_out`` in BF16; its choice is overridden
with ours. 1x1 convs are handed to modelopt and torchao as an ``nn.Linear`` over
channels-last pixels (:class:`ConvAsLinear`), so their NVFP4 blocks run along the input
channels (modelopt's own conv quantizer would block along the kernel width).

modelopt and torchao are optional (``pip install diffrl[modelopt]`` / ``[torchao]``)
and imported only when chosen.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from diffrl.quant.exploration import PRECISIONS, ConvAsLinear, ExplorationCopy, swap_pointwise_convs
from diffrl.quant.keep_high import default_keep_high
from diffrl.quant.modelopt_copy import ModelOptCopy

BACKENDS = ("auto", "reference", "modelopt", "torchao", "none")
_PIP = {"modelopt": "pip install nvidia-modelopt[torch]", "torchao": "pip install torchao"}
_PROBE = {"modelopt": "modelopt.torch.quantization", "torchao": "torchao.quantization"}


# -- hardware ----------------------------------------------------------------------------
def capability_flags(capability: tuple[int, int] | None) -> tuple[bool, bool]:
    """(has FP8 tensor cores, has FP4 tensor cores) of a CUDA compute capability: FP8
    from Ada/Hopper (sm_89, sm_90), NVFP4 from Blackwell (sm_100, sm_120)."""
    if capability is None:
        return False, False
    return tuple(capability) >= (8, 9), tuple(capability) >= (10, 0)


@functools.cache
def _imports(package: str) -> bool:
    """Whether the optional package imports (not just whether it is installed)."""
    try:
        importlib.import_module(_PROBE[package])
    except Exception:  # a broken install fails in many ways; any of them means "unavailable"
        return False
    return True


def detect_hardware(probe_imports: bool | None = None) -> dict:
    """What this machine offers the exploration copy (CUDA device 0). The optional
    packages are import-probed only where they could run (``probe_imports=None``: a GPU
    with FP8 tensor cores), since importing modelopt takes seconds."""
    cuda = torch.cuda.is_available()
    capability = tuple(torch.cuda.get_device_capability(0)) if cuda else None
    has_fp8, has_nvfp4 = capability_flags(capability)
    probe = has_fp8 if probe_imports is None else probe_imports
    return {
        "cuda": cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else "CPU",
        "capability": capability,
        "has_fp8": has_fp8,
        "has_nvfp4": has_nvfp4,
        "modelopt": probe and _imports("modelopt"),
        "torchao": probe and _imports("torchao"),
    }


def _where(hw: dict) -> str:
    if not hw["cuda"]:
        return "the CPU (no CUDA GPU)"
    major, minor = hw["capability"]
    return f"{hw['device_name']} (sm_{major}{minor})"


# -- choosing ----------------------------------------------------------------------------
def choose_backend(precision: str, requested: str = "auto", hw: dict | None = None) -> tuple[str, str]:
    """(backend, reason) for an exploration copy at ``precision``; the reason is a
    sentence for the log. An explicitly requested backend that cannot run here raises
    a ValueError saying what is missing and how to fix it."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown exploration precision '{precision}'; valid: {', '.join(PRECISIONS)}")
    if requested not in BACKENDS:
        raise ValueError(f"unknown quantization backend '{requested}'; valid: {', '.join(BACKENDS)}")
    if precision == "bf16":
        if requested not in ("auto", "none", "reference"):
            raise ValueError(
                f"precision bf16 quantizes nothing, so backend '{requested}' does not apply; "
                "use backend auto or none"
            )
        return "none", "BF16 control: LoRA merged, nothing quantized"
    if requested == "none":
        raise ValueError(
            f"backend none runs no quantizer; for precision {precision} use auto, reference, "
            "modelopt or torchao (or set precision bf16)"
        )
    if requested == "reference":
        return "reference", f"requested: pure-PyTorch fake {precision} (numerics only, no speed-up)"
    hw = detect_hardware(probe_imports=None if requested == "auto" else True) if hw is None else hw
    if requested == "auto":
        return _auto_fp8(hw) if precision == "fp8" else _auto_nvfp4(hw)
    _check_requested(precision, requested, hw)
    return requested, f"requested: {_describe(precision, requested, hw)}"


def _auto_fp8(hw: dict) -> tuple[str, str]:
    if hw["has_fp8"] and hw["torchao"]:
        return "torchao", _describe("fp8", "torchao", hw)
    if not hw["cuda"]:
        why = "no CUDA GPU"
    elif not hw["has_fp8"]:
        why = f"{_where(hw)} has no FP8 tensor cores (sm_89+)"
    else:
        why = f"torchao is not installed ({_PIP['torchao']} for real FP8 GEMMs on {_where(hw)})"
    return "reference", f"{why}: pure-PyTorch fake fp8 (numerics only, no speed-up)"


def _auto_nvfp4(hw: dict) -> tuple[str, str]:
    # modelopt's NVFP4 fake quant is a Triton kernel for sm_89+; older GPUs fall back to
    # a CUDA extension compiled at run time, which is not a safe default
    if hw["has_fp8"] and hw["modelopt"]:
        return "modelopt", _describe("nvfp4", "modelopt", hw)
    if not hw["cuda"]:
        why = "no CUDA GPU (modelopt's NVFP4 kernels need one)"
    elif not hw["has_fp8"]:
        why = f"{_where(hw)} is older than sm_89, which modelopt's NVFP4 Triton kernel needs"
    else:
        why = f"modelopt is not installed ({_PIP['modelopt']})"
    return "reference", f"{why}: pure-PyTorch fake nvfp4 (numerics only, no speed-up)"


def _describe(precision: str, backend: str, hw: dict) -> str:
    if backend == "torchao":
        return f"real FP8 GEMMs on {_where(hw)} via torchao under torch.compile"
    if precision == "fp8":
        return f"modelopt FP8 fake quant on {_where(hw)} (simulated: numerics only)"
    if hw["has_nvfp4"]:
        return (
            f"{_where(hw)} has FP4 tensor cores (Blackwell), but this copy runs modelopt's NVFP4 "
            "fake quant: NVFP4 numerics, BF16 speed"
        )
    return f"{_where(hw)} has no FP4 tensor cores: NVFP4 simulated by modelopt fake quant (numerics only)"


def _check_requested(precision: str, backend: str, hw: dict) -> None:
    """Raise one clear error if ``backend`` cannot run ``precision`` here."""
    if backend == "torchao" and precision != "fp8":
        raise ValueError(
            f"backend torchao runs fp8 only in diffrl, not {precision}; "
            "use backend modelopt or reference for nvfp4"
        )
    if not hw[backend]:
        raise ValueError(
            f"backend {backend} needs the {backend} package, which does not import here: "
            f"{_PIP[backend]} (or pip install 'diffrl[{backend}]'), or use backend reference"
        )
    if backend == "torchao" and not hw["has_fp8"]:
        raise ValueError(
            f"backend torchao needs a CUDA GPU with FP8 tensor cores (sm_89+: Ada, Hopper, "
            f"Blackwell); found {_where(hw)}; use backend reference"
        )
    if backend == "modelopt" and precision == "nvfp4" and not hw["cuda"]:
        raise ValueError(
            "backend modelopt's NVFP4 quantizers run only on a CUDA GPU (they fail on CPU); "
            "use backend reference"
        )


# -- torchao -----------------------------------------------------------------------------
def _copy_inner_(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Copy a traceable tensor subclass's inner tensors (torchao's qdata and scale) in
    place, so the Parameter object stays and torch.compile has no reason to recompile.
    False when the two are not laid out alike."""
    if type(old) is not type(new) or not hasattr(old, "__tensor_flatten__"):
        return False
    names, _ = old.__tensor_flatten__()
    if names != new.__tensor_flatten__()[0]:
        return False
    pairs = [(getattr(old, n), getattr(new, n)) for n in names]
    if any(a.shape != b.shape or a.dtype != b.dtype for a, b in pairs):
        return False
    with torch.no_grad():
        for a, b in pairs:
            a.copy_(b)
    return True


class TorchaoCopy(ExplorationCopy):
    """FP8 exploration copy through torchao (real FP8 GEMMs on sm_89+). Sync re-quantizes
    each quantized weight from the merged high-precision weight with the same config and
    copies the FP8 data and scales into the existing weight tensors."""

    backend = "torchao"

    def __init__(self, transformer: nn.Module, keep_high=(), compile: bool = True, device=None):
        self._config = None
        super().__init__(transformer, "fp8", keep_high, device)
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        self._quantize_ = quantize_
        # torchao's per-row FP8 recipe quantizes BF16 weights only (it asserts so), and
        # Sol-RL explores in BF16 + FP8 anyway: a copy of fp32 weights (a full fine-tune's
        # master weights, the fp32 twins) runs its unquantized layers in BF16 too
        self.model.to(torch.bfloat16)
        self._dtypes = {n: torch.bfloat16 for n in self.quantized}
        targets = swap_pointwise_convs(self.model, self.quantized)
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        quantize_(self.model, config, filter_fn=lambda _m, fqn: fqn in targets)
        self._config = config
        self._eager = self.model
        self.model = torch.compile(self._eager) if compile else self._eager

    @property
    def module(self) -> nn.Module:
        return self.__dict__.get("_eager", self.model)

    def _install_quantizers(self) -> None:
        """torchao quantizes activations inside its FP8 linear."""

    def quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """High precision until torchao has quantized the model (see ``_write_layer``)."""
        return weight

    def _write_layer(self, name: str, target: nn.Module, weight: torch.Tensor) -> None:
        if self._config is None or name not in self._quantized_set:
            return super()._write_layer(name, target, weight)
        linear = target.linear if isinstance(target, ConvAsLinear) else target
        fresh = nn.Linear(
            linear.in_features,
            linear.out_features,
            bias=False,
            device=linear.weight.device,
            dtype=self._dtypes[name],
        )
        fresh.weight.data.copy_(weight.reshape(fresh.weight.shape).to(fresh.weight.device))
        self._quantize_(fresh, self._config)
        if not _copy_inner_(linear.weight, fresh.weight):
            linear.weight = fresh.weight  # a new Parameter: correct, but compile may recompile


# -- entry point -------------------------------------------------------------------------
def build_exploration_copy(
    transformer: nn.Module,
    family: str,
    precision: str,
    backend: str = "auto",
    keep_high=None,
    log=print,
    *,
    forward_loop=None,
    compile: bool = True,
    device=None,
):
    """The exploration copy of ``transformer`` at ``precision``, on the backend that
    ``choose_backend`` picks (or the one requested). ``keep_high=None`` uses the family's
    default list. Logs one line saying which path runs and why. The result has
    ``.model`` (call it to explore), ``.precision``, ``.backend`` and ``.sync(transformer)``
    (reload the merged weights and re-quantize; call it after every optimizer step).

    ``forward_loop`` (modelopt only) runs calibration batches through a model;
    ``compile`` (torchao only) wraps the model in ``torch.compile``; ``device`` places the
    copy there before it is quantized (default: the transformer's device).
    """
    defaults = default_keep_high(family)  # also checks the family
    patterns = defaults if keep_high is None else tuple(keep_high)
    chosen, reason = choose_backend(precision, backend)
    if chosen == "modelopt":
        copy = ModelOptCopy(transformer, precision, patterns, forward_loop=forward_loop, device=device)
    elif chosen == "torchao":
        copy = TorchaoCopy(transformer, patterns, compile=compile, device=device)
    else:
        copy = ExplorationCopy(transformer, precision, patterns, device=device)
        copy.backend = chosen
    source = f"{family} defaults" if keep_high is None else "custom keep_high"
    if precision == "bf16":
        counts = f"nothing quantized, {len(copy.quantizable)} quantizable layers in BF16"
    else:
        counts = f"{len(copy.quantized)} layers quantized, {len(copy.kept)} kept high ({source})"
        others = len(copy.layer_names) - len(copy.quantizable)
        if others:
            counts += f", {others} non-1x1 convs high"

    log(f"exploration copy: {precision} via {chosen} ({reason}); {counts}")
    return copy
