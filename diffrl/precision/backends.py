"""Which code runs the low-precision exploration copy, and why.

* ``reference``: pure-PyTorch fake quantization (:class:`ExplorationCopy`), exact to the
  formats, on any device. Numerics only, slower than BF16.
* ``modelopt``: NVIDIA ModelOpt's ``mtq.quantize`` with ``NVFP4_DEFAULT_CFG`` /
  ``FP8_DEFAULT_CFG``. Its quantizers are fake quant (quantize-dequantize) in
  Triton/CUDA kernels, so they need a CUDA GPU and run at BF16 speed or slower, on
  Blackwell too: NVFP4 numerics, not NVFP4 speed. The copy (``modelopt_copy.py``) folds
  its quantized weights once per sync, so a forward quantizes activations only.
* ``torchao``: real low-precision GEMMs. FP8 (E4M3) dynamic activations and weights,
  ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``: every linear
  becomes ``torch._scaled_mm`` with a scale per token and per output row, on GPUs with
  FP8 tensor cores (sm_89+: Ada, Hopper, Blackwell); that is where Hopper's speed comes
  from. NVFP4 dynamic activations and weights (``NVFP4DynamicActivationNVFP4WeightConfig``,
  torchao's prototype mx_formats): FP4 GEMMs on Blackwell (sm_100+) only, the one place
  NVFP4 runs faster than BF16. Per-row (FP8) and per-block (NVFP4) scales keep, as in the
  reference path, a sample's numerics independent of the rest of its batch.
* ``none``: the BF16 control.

``precision: auto`` (the default) follows the hardware: NVFP4 through torchao where FP4
GEMMs run (Blackwell), FP8 through torchao where FP8 GEMMs run (Ada, Hopper), and
elsewhere FP8 through the reference quantizer, saying that it is numerics only.

The torchao copy is compiled block by block (:mod:`diffrl.runtime.regional`), and torchao's
``set_inductor_config`` is off: left on, ``quantize_`` turns on coordinate-descent tuning
for every later compile in the process, the policy's included, which made the first
GPU run's compile miss its 290 s.

Every backend quantizes the same layers: ``nn.Linear`` and 1x1 convs, minus the
family's keep-high list (and for torchao's NVFP4, layers whose dimensions are not
multiples of its 16-element blocks, kept in BF16). ModelOpt's default configs disable
``*proj_out.*`` by name, which would keep FLUX's single-block ``proj_out`` in BF16; its
choice is overridden with ours. 1x1 convs are handed to modelopt and torchao as an
``nn.Linear`` over channels-last pixels (:class:`ConvAsLinear`), so their NVFP4 blocks
run along the input channels (modelopt's own conv quantizer would block along the
kernel width).

modelopt and torchao are optional (``pip install diffrl[modelopt]`` / ``[torchao]``)
and imported only when chosen.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from diffrl.precision.exploration import PRECISIONS, ConvAsLinear, ExplorationCopy, swap_pointwise_convs
from diffrl.precision.keep_high import default_keep_high
from diffrl.precision.modelopt_copy import ModelOptCopy

BACKENDS = ("auto", "reference", "modelopt", "torchao", "none")
_PIP = {"modelopt": "pip install nvidia-modelopt[torch]", "torchao": "pip install torchao"}
_PROBE = {"modelopt": "modelopt.torch.quantization", "torchao": "torchao.quantization"}
# torchao's NVFP4 inference config, by the names its releases gave it
_NVFP4_CONFIGS = ("NVFP4DynamicActivationNVFP4WeightConfig", "NVFP4InferenceConfig")


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


def torchao_nvfp4_config():
    """torchao's NVFP4 dynamic-activation config class, or None where this torchao has none."""
    try:
        module = importlib.import_module("torchao.prototype.mx_formats")
    except Exception:  # a broken or old install: no NVFP4 through torchao
        return None
    return next((getattr(module, n) for n in _NVFP4_CONFIGS if hasattr(module, n)), None)


def detect_hardware(probe_imports: bool | None = None) -> dict:
    """What this machine offers the exploration copy (CUDA device 0). The optional
    packages are import-probed only where they could run (``probe_imports=None``: a GPU
    with FP8 tensor cores), since importing modelopt takes seconds. ``torchao_nvfp4``:
    torchao's real NVFP4 GEMMs can run here (Blackwell and a torchao that has them)."""
    cuda = torch.cuda.is_available()
    capability = tuple(torch.cuda.get_device_capability(0)) if cuda else None
    has_fp8, has_nvfp4 = capability_flags(capability)
    probe = has_fp8 if probe_imports is None else probe_imports
    torchao = probe and _imports("torchao")
    return {
        "cuda": cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else "CPU",
        "capability": capability,
        "has_fp8": has_fp8,
        "has_nvfp4": has_nvfp4,
        "modelopt": probe and _imports("modelopt"),
        "torchao": torchao,
        "torchao_nvfp4": bool(torchao and has_nvfp4 and torchao_nvfp4_config() is not None),
    }


def _where(hw: dict) -> str:
    if not hw["cuda"]:
        return "the CPU (no CUDA GPU)"
    major, minor = hw["capability"]
    return f"{hw['device_name']} (sm_{major}{minor})"


# -- choosing ----------------------------------------------------------------------------
def choose_precision(requested: str, hw: dict | None = None) -> tuple[str, str]:
    """(precision, reason) for ``solrl.precision``: a named one as it is; ``auto`` the
    one this hardware runs fastest (NVFP4 where torchao's FP4 GEMMs run, FP8 where its
    FP8 GEMMs run, else FP8 numerics through the reference quantizer)."""
    if requested != "auto":
        if requested not in PRECISIONS:
            valid = ", ".join(("auto", *PRECISIONS))
            raise ValueError(f"unknown exploration precision '{requested}'; valid: {valid}")
        return requested, "requested"
    hw = detect_hardware() if hw is None else hw
    if hw.get("torchao_nvfp4"):
        return "nvfp4", f"auto: {_where(hw)} runs FP4 GEMMs (torchao NVFP4)"
    if hw["has_fp8"] and hw["torchao"]:
        return "fp8", f"auto: {_where(hw)} runs FP8 GEMMs (torchao), not FP4 ones"
    return "fp8", f"auto: no real low-precision GEMMs on {_where(hw)}: FP8 numerics, slower than BF16"


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
    return "reference", f"{why}: pure-PyTorch fake fp8 (numerics only, slower than BF16)"


def _auto_nvfp4(hw: dict) -> tuple[str, str]:
    # real FP4 GEMMs first (Blackwell); modelopt's NVFP4 fake quant is a Triton kernel for
    # sm_89+; older GPUs fall back to a CUDA extension compiled at run time, which is not
    # a safe default
    if hw.get("torchao_nvfp4"):
        return "torchao", _describe("nvfp4", "torchao", hw)
    if hw["has_fp8"] and hw["modelopt"]:
        return "modelopt", _describe("nvfp4", "modelopt", hw)
    if not hw["cuda"]:
        why = "no CUDA GPU (modelopt's NVFP4 kernels need one)"
    elif not hw["has_fp8"]:
        why = f"{_where(hw)} is older than sm_89, which modelopt's NVFP4 Triton kernel needs"
    else:
        why = f"modelopt is not installed ({_PIP['modelopt']})"
    return "reference", f"{why}: pure-PyTorch fake nvfp4 (numerics only, slower than BF16)"


def _describe(precision: str, backend: str, hw: dict) -> str:
    if backend == "torchao":
        kind = "FP4" if precision == "nvfp4" else "FP8"
        return f"real {kind} GEMMs on {_where(hw)} via torchao, compiled by block"
    if precision == "fp8":
        return f"modelopt FP8 fake quant on {_where(hw)} (simulated: numerics only)"
    if hw["has_nvfp4"]:
        return (
            f"{_where(hw)} has FP4 tensor cores (Blackwell), but this copy runs modelopt's NVFP4 "
            "fake quant: NVFP4 numerics, BF16 speed (install a torchao with NVFP4 for FP4 GEMMs)"
        )
    return (
        f"{_where(hw)} has no FP4 tensor cores: NVFP4 simulated by modelopt fake quant "
        "(numerics only, slower than BF16; FP8 is the fast precision here)"
    )


def _check_requested(precision: str, backend: str, hw: dict) -> None:
    """Raise one clear error if ``backend`` cannot run ``precision`` here."""
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
    if backend == "torchao" and precision == "nvfp4" and not hw.get("torchao_nvfp4"):
        raise ValueError(
            f"backend torchao runs nvfp4 with real FP4 GEMMs only on Blackwell (sm_100+) with a "
            f"torchao that has {_NVFP4_CONFIGS[0]}; found {_where(hw)}; use backend modelopt or "
            "reference for NVFP4 numerics, or precision fp8 for speed"
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


def torchao_config(precision: str):
    """torchao's quantization config for ``precision``: FP8 per-row dynamic activations
    and weights, or NVFP4 dynamic activations and weights; inductor settings untouched."""
    if precision == "fp8":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    config = torchao_nvfp4_config()
    if precision != "nvfp4" or config is None:
        raise ValueError(f"torchao runs fp8, or nvfp4 where it has {_NVFP4_CONFIGS[0]}; not {precision}")
    # its fused activation kernel needs the optional MSLK package; the plain path needs nothing more
    return config(use_triton_kernel=False)


def _fits_nvfp4_blocks(layer: nn.Module) -> bool:
    linear = layer.linear if isinstance(layer, ConvAsLinear) else layer
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


class TorchaoCopy(ExplorationCopy):
    """Exploration copy through torchao: real FP8 GEMMs on sm_89+, real NVFP4 GEMMs on
    sm_100+. Sync re-quantizes each quantized weight from the merged high-precision
    weight with the same config and copies the quantized data and scales into the
    existing weight tensors, so the compiled blocks see them without recompiling."""

    backend = "torchao"

    def __init__(
        self,
        transformer: nn.Module,
        keep_high=(),
        compile: bool = True,
        device=None,
        precision: str = "fp8",
        min_dim: int = 0,
    ):
        self._config = None
        super().__init__(transformer, precision, keep_high, device, min_dim)
        from torchao.quantization import quantize_

        self._quantize_ = quantize_
        # torchao quantizes BF16 weights only (its per-row FP8 recipe asserts so), and
        # Sol-RL explores in BF16 + low precision anyway: a copy of fp32 weights (a full
        # fine-tune's master weights, the fp32 twins) runs its unquantized layers in BF16 too
        self.model.to(torch.bfloat16)
        targets = swap_pointwise_convs(self.model, self.quantized)
        if precision == "nvfp4":
            self._keep_unfit_layers()
            targets = {n for n in targets if n.removesuffix(".linear") in self._quantized_set}
        self._dtypes = {n: torch.bfloat16 for n in self.quantized}
        config = torchao_config(precision)
        quantize_(self.model, config, filter_fn=lambda _m, fqn: fqn in targets)
        self._config = config
        self._eager = self.model
        self.model = compile_by_block(self._eager) if compile else self._eager

    def _keep_unfit_layers(self) -> None:
        """NVFP4 quantizes 16-element blocks: a layer whose widths are not multiples of 16
        stays in BF16 and is listed as kept."""
        unfit = [n for n in self.quantized if not _fits_nvfp4_blocks(self.model.get_submodule(n))]
        self.quantized = [n for n in self.quantized if n not in unfit]
        self.kept = [*self.kept, *unfit]
        self._quantized_set = set(self.quantized)

    @property
    def module(self) -> nn.Module:
        return self.__dict__.get("_eager", self.model)

    def _install_quantizers(self) -> None:
        """torchao quantizes activations inside its quantized linear."""

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


def compile_by_block(model: nn.Module, **compile_kwargs):
    """``model`` with its repeated blocks compiled (:class:`diffrl.runtime.regional.RegionalCompile`,
    ``fullgraph``), or compiled whole where it has none."""
    from diffrl.runtime.regional import RegionalCompile, repeated_block_classes

    if not repeated_block_classes(model):
        return torch.compile(model, **compile_kwargs)
    return RegionalCompile(model, log=None, fullgraph=True, **compile_kwargs)


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
    min_dim: int = 0,
):
    """The exploration copy of ``transformer`` at ``precision`` (``auto``: the one this
    hardware runs fastest, :func:`choose_precision`), on the backend that
    ``choose_backend`` picks (or the one requested). ``keep_high=None`` uses the family's
    default list. Logs one line saying which path runs and why. The result has
    ``.model`` (call it to explore), ``.precision``, ``.backend`` and ``.sync(transformer)``
    (reload the merged weights and re-quantize; call it after every optimizer step).

    ``forward_loop`` (modelopt only) runs calibration batches through a model;
    ``compile`` (torchao only) compiles the model block by block; ``device`` places the
    copy there before it is quantized (default: the transformer's device); ``min_dim``
    keeps layers whose larger dimension is at most that in high precision
    (``solrl.min_quantized_dim``).
    """
    defaults = default_keep_high(family)  # also checks the family
    patterns = defaults if keep_high is None else tuple(keep_high)
    precision, why_precision = choose_precision(precision)
    chosen, reason = choose_backend(precision, backend)
    if chosen == "modelopt":
        copy = ModelOptCopy(
            transformer, precision, patterns, forward_loop=forward_loop, device=device, min_dim=min_dim
        )
    elif chosen == "torchao":
        copy = TorchaoCopy(transformer, patterns, compile, device, precision, min_dim)
    else:
        copy = ExplorationCopy(transformer, precision, patterns, device=device, min_dim=min_dim)
        copy.backend = chosen
    source = f"{family} defaults" if keep_high is None else "custom keep_high"
    if precision == "bf16":
        counts = f"nothing quantized, {len(copy.quantizable)} quantizable layers in BF16"
    else:
        counts = f"{len(copy.quantized)} layers quantized, {len(copy.kept)} kept high ({source}"
        counts += f"; {len(copy.narrow)} at most {min_dim} wide)" if copy.narrow else ")"
        others = len(copy.layer_names) - len(copy.quantizable)
        if others:
            counts += f", {others} non-1x1 convs high"
    chose = "" if why_precision == "requested" else f" [{why_precision}]"
    log(f"exploration copy: {precision} via {chosen} ({reason}){chose}; {counts}")
    return copy
