"""torchao's float8 training GEMM as the FP8 flow uses it, behind one tested seam.

What the flow needs from torchao is not in its public API: ``Float8Linear`` (public, through
``convert_to_float8_training``) owns its weight, while the flow quantizes W + B A of a LoRA
layer, so it calls the autograd function ``Float8Linear`` itself calls,
``float8_linear.matmul_with_hp_or_float8_args``, and, to cast a rollout phase's weights
once, ``float8_scaling_utils.hp_tensor_to_float8_dynamic`` with the arguments that function
would pass. Those are internals: they are imported here and nowhere else, only for the
torchao versions this code is tested with (:data:`TESTED`, the ``torchao`` extra pins the
same range), and any other version gets one line naming itself and the range instead of
an error inside a rollout: ``precision.backend: auto`` falls back to the reference casts,
an explicit ``torchao`` is refused at start (:func:`torchao_problem`).

The row-wise and tensor-wise recipes are torchao's (``Float8LinearConfig.from_recipe_name``);
tests/precision/test_fp8_flow.py checks a linear through this seam against the reference
casts on the CPU, outputs and input gradients bit for bit.
"""

from __future__ import annotations

import functools
import importlib.metadata

# minor versions whose internals this module was read against and tested with
TESTED = ((0, 17), (0, 18))
PIN = "torchao>=0.17,<0.19"


def torchao_version() -> str | None:
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


@functools.cache
def torchao_problem() -> str | None:
    """Why the flow cannot use this torchao (a sentence naming the version and the fix),
    or None where it can."""
    version = torchao_version()
    if version is None:
        return f"torchao is not installed (pip install '{PIN}')"
    if _minor(version) not in TESTED:
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED)
        return (
            f"torchao {version} is installed; the FP8 flow calls torchao internals tested with {tested} "
            f"only (pip install '{PIN}')"
        )
    try:
        _internals()
    except Exception as err:  # noqa: BLE001 (a broken install fails in many ways; each is said)
        return f"torchao {version} does not import its float8 training GEMM ({type(err).__name__}: {err})"
    return None


def _internals():
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    return (
        Float8LinearConfig,
        Float8Linear,
        matmul_with_hp_or_float8_args,
        hp_tensor_to_float8_dynamic,
        get_maybe_axiswise_dim,
        GemmInputRole,
    )


class TorchaoFloat8:
    """torchao's float8 training GEMM for one recipe (``rowwise`` or ``tensorwise``):
    ``matmul(x, w)`` is x @ w^T with both operands cast as ``Float8Linear`` casts them;
    ``cast_weight(w)`` casts a weight once (a rollout phase's), and ``matmul`` takes that
    cast in place of ``w``, skipping its own."""

    def __init__(self, scaling: str):
        problem = torchao_problem()
        if problem is not None:
            raise RuntimeError(problem)
        config_cls, linear_cls, self._mm, self._to_float8, self._axiswise, self._roles = _internals()
        self.config = config_cls.from_recipe_name(scaling)
        from torch import nn

        # the GEMM settings a Float8Linear of this config would use (emulation off, accumulation)
        layer = linear_cls.from_float(nn.Linear(16, 16, device="meta"), config=self.config)
        self.mm_config = layer.linear_mm_config

    def cast_weight(self, w):
        """w^T cast as ``matmul_with_hp_or_float8_args`` casts its weight operand."""
        cast = self.config.cast_config_weight
        return self._to_float8(
            w.t(),
            cast.target_dtype,
            self.mm_config,
            gemm_input_role=self._roles.WEIGHT,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=self._axiswise(0, cast.scaling_granularity),
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )

    def matmul(self, x, w):
        return self._mm.apply(x, w.t(), self.mm_config, self.config)

    def matmul_cast(self, x, w_cast):
        return self._mm.apply(x, w_cast, self.mm_config, self.config)
