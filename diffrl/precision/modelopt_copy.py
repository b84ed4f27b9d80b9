"""The exploration copy quantized by NVIDIA ModelOpt (``backend: modelopt``).

ModelOpt's ``mtq.quantize`` wraps every ``nn.Linear`` in a ``QuantLinear`` with an input
and a weight ``TensorQuantizer``; by default both fake-quantize (quantize-dequantize) in
every forward. Exploration runs many forwards between two syncs with the same weights,
so re-quantizing them each time is wasted work (issue 37, defect 8). After each sync the
weights are calibrated and then folded once with ModelOpt's own ``mtq.fold_weight``
(``modelopt.torch.quantization.model_quant.fold_weight``: the weight is replaced by its
quantize-dequantize and the weight quantizer is disabled), so a forward quantizes only
its activations. The next sync re-enables the weight quantizers, loads the policy's
merged high-precision weights (never the folded ones) and folds again.

NVFP4's weight quantizer is a dynamic block quantizer whose kernels need CUDA, so for
NVFP4 folding, like the forward, runs only on a GPU; the code path is the same as FP8's,
which is tested on CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from diffrl.precision.exploration import ExplorationCopy, swap_pointwise_convs


def fp8_per_row_config(default: dict) -> dict:
    """modelopt's FP8 recipe with the reference quantizer's granularity: one scale per
    output row of a weight (axis 0) and one per token of an activation (its last dim
    reduced: ``block_sizes {-1: None}``), as torchao's ``PerRow`` copy scales them, where
    modelopt's default takes one per tensor for both."""
    weight = {"num_bits": (4, 3), "axis": 0}
    token = {"num_bits": (4, 3), "block_sizes": {-1: None}}
    extra = [
        {"quantizer_name": "*weight_quantizer", "cfg": weight},
        {"quantizer_name": "*input_quantizer", "cfg": token},
    ]
    return {**default, "quant_cfg": [*default["quant_cfg"], *extra]}


def _owner(quantizer: str) -> str:
    return quantizer.rpartition(".")[0]


class ModelOptCopy(ExplorationCopy):
    """Exploration copy quantized by NVIDIA ModelOpt. Sync loads the merged
    high-precision weights, resets and re-runs the max calibration (the NVFP4 tensor
    scale amax / (6 * 448), FP8's amax / 448, then comes from the new weights, never a
    stale one: modelopt's max calibrator would otherwise keep the running max of the old
    and new weights), then folds the weight quantizers into the weights (``fold=True``)
    so forwards quantize activations only. ``fold=False`` keeps modelopt's default of
    fake-quantizing the weights in every forward (the same numbers, slower).

    Without ``forward_loop`` (a callable running calibration batches through the model),
    input quantizers have no calibrated amax and compute it per call, per token (FP8)
    or over the whole batch (NVFP4); with it, input amax is static and re-calibrated at
    every sync.
    """

    backend = "modelopt"

    def __init__(
        self,
        transformer: nn.Module,
        precision: str,
        keep_high=(),
        forward_loop=None,
        device=None,
        fold=True,
        min_dim: int = 0,
    ):
        if precision not in ("nvfp4", "fp8"):
            raise ValueError(f"ModelOptCopy quantizes nvfp4 or fp8, not '{precision}'")
        self.forward_loop, self.fold = forward_loop, fold
        self._mtq = None
        super().__init__(transformer, precision, keep_high, device, min_dim)
        import modelopt.torch.quantization as mtq

        self._targets = swap_pointwise_convs(self.model, self.quantized)
        config = mtq.NVFP4_DEFAULT_CFG if precision == "nvfp4" else fp8_per_row_config(mtq.FP8_DEFAULT_CFG)
        self.model = mtq.quantize(self.model, {**config, "algorithm": None})  # calibrated below
        # our keep-high list decides, not modelopt's name-based disables (``*proj_out.*``)
        mtq.disable_quantizer(self.model, lambda q: _owner(q) not in self._targets)
        mtq.enable_quantizer(self.model, self._ours)
        self._mtq = mtq
        self._requantize()

    def _ours(self, quantizer: str) -> bool:
        """The input and weight quantizers of the layers we quantize."""
        kind = quantizer.rpartition(".")[2]
        return _owner(quantizer) in self._targets and kind in ("weight_quantizer", "input_quantizer")

    def _install_quantizers(self) -> None:
        """modelopt inserts its own quantizers."""

    def quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """Loaded in high precision: modelopt quantizes the weights after calibration."""
        return weight

    def sync(self, transformer: nn.Module) -> None:
        super().sync(transformer)
        if self._mtq is not None:
            self._requantize()

    def _requantize(self) -> None:
        """Calibrate on the freshly loaded high-precision weights, then fold them."""
        # folding disabled the weight quantizers; the weights are high precision again
        self._mtq.enable_quantizer(self.model, self._ours)
        self._calibrate()
        if self.fold:
            # keep_attrs: the calibrated amax stays readable and is reset at the next sync
            self._mtq.fold_weight(self.model, keep_attrs=True)

    def _calibrate(self) -> None:
        from modelopt.torch.quantization.nn import TensorQuantizer

        for module in self.model.modules():
            calibrated = getattr(module, "_calibrator", None) is not None
            if isinstance(module, TensorQuantizer) and module.is_enabled and calibrated:
                module.reset_amax()
        self._mtq.calibrate(self.model, algorithm="max", forward_loop=self.forward_loop)
