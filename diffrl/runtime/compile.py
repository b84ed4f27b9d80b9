"""Compiling a run's transformer for rollouts (``perf.compile_rollout``, ``compile_scope``,
``compile_mode``): by block (:mod:`diffrl.runtime.regional`) or whole.

Each switch is measured by ``scripts/bench_rollout.py --sections optimisations`` (one
forward) and ``--vs perf.KEY=VALUE`` (whole iterations); docs/BENCHMARKS.md records
where each pays, and the defaults keep off what has not been shown to.
"""

from __future__ import annotations

import torch

from diffrl.schema import ConfigError


class CompiledOrEager:
    """Calls ``torch.compile(module)``; if compiling fails (no C++ compiler for inductor on
    a CPU, an op dynamo cannot trace), says so once and runs ``module`` eagerly from then
    on. A genuine error in the model then surfaces from the eager call, unchanged.

    Attribute access reaches ``module`` (``config``, ``dtype``), and ``.module`` lets
    :func:`diffrl.models.base.unwrap` find it. The compiled graph reads the module's
    parameters at each call, so optimizer steps and exploration-copy syncs stay visible.
    """

    def __init__(self, module: torch.nn.Module, mode: str | None, log=print, exact: bool = False):
        self.module = module
        self._compiled = torch.compile(module, **compile_kwargs(mode, exact))
        self._graphs = mode == "reduce-overhead"
        self._log = log

    def __call__(self, *args, **kwargs):
        if self._compiled is not None:
            try:
                out = self._compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise  # a real condition of the run, not a compile failure
            except Exception as err:  # noqa: BLE001 (any compile failure: fall back, the eager call re-raises real errors)
                self._compiled = None
                self._log(
                    f"perf.compile_rollout: torch.compile failed ({type(err).__name__}: "
                    f"{str(err).splitlines()[0][:200]}); running {type(self.module).__name__} eagerly"
                )
            else:
                # CUDA-graph outputs live in a pool that the next replay overwrites, and the
                # samplers keep chunk outputs across calls: hand out copies
                return _cloned(out) if self._graphs else out
        return self.module(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)


def compile_kwargs(mode: str | None, exact: bool) -> dict:
    """``torch.compile`` arguments for ``mode`` (None: the default), with inductor's
    ``emulate_precision_casts`` where ``exact`` asks for it.

    Why: eager PyTorch rounds every operator's output to the tensor's dtype (bf16 under
    autocast, or bf16 weights); inductor fuses operators and keeps the values between them
    in fp32, skipping those roundings, so a compiled rollout computes another velocity
    than the eager training forward that replays it (issue 61: replay gaps 7e-5 to 1e-3 on
    the FLUX and SD3 twins, whole FP8 steps once the unified flow rounds the difference).
    With the emulation each fused kernel rounds where eager code would (PyTorch's
    ``torch/_inductor/config.py``: "emulate the precision casts ... for numerical parity
    with eager"). ``torch.compile`` takes a mode or options, not both: a mode is spelt as
    its options (``torch._inductor.list_mode_options``) so the two combine."""
    if not exact:
        return {"mode": mode}
    options = dict(torch._inductor.list_mode_options(mode)) if mode is not None else {}
    options["emulate_precision_casts"] = True
    return {"options": options}


def _cloned(out):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def compiled(module: torch.nn.Module, perf, log=print):
    """``module`` compiled as ``perf`` says, for rollouts (rounding as eager code does
    with ``perf.exact_replay``, :func:`compile_kwargs`): by block
    (:class:`diffrl.runtime.regional.RegionalCompile`, in place, gradients-off calls only,
    ``fullgraph``; its first call's time is logged) or whole (:class:`CompiledOrEager`);
    ``module`` itself when ``perf.compile_rollout`` is off."""
    if not perf.compile_rollout:
        return module
    if perf.compile_mode == "reduce-overhead" and perf.compile_scope == "blocks":
        raise ConfigError(
            "perf.compile_mode: reduce-overhead replays one CUDA graph per block class, and a replay "
            "overwrites the previous block's output (the next block's input); set perf.compile_scope: "
            "whole for CUDA graphs"
        )
    if perf.compile_mode == "reduce-overhead" and next(module.parameters()).device.type != "cuda":
        raise ConfigError(
            "perf.compile_mode: reduce-overhead captures CUDA graphs and needs a CUDA device; "
            "use the default mode on this machine"
        )
    mode = None if perf.compile_mode == "default" else perf.compile_mode
    if perf.compile_scope == "blocks":
        from diffrl.runtime.regional import RegionalCompile, repeated_block_classes

        if repeated_block_classes(module):
            return RegionalCompile(
                module,
                inference_only=True,
                log=log,
                label="perf.compile_rollout",
                fullgraph=True,
                **compile_kwargs(mode, perf.exact_replay),
            )
        log(f"perf.compile_rollout: {type(module).__name__} has no repeated blocks; compiling it whole")
    return CompiledOrEager(module, mode, log, exact=perf.exact_replay)
