"""Regional compilation: compile each repeated transformer block, not the whole model.

A diffusion transformer is a stack of identical blocks (FLUX.1: 19 double and 38 single).
``torch.compile`` of the whole model traces and optimises every block again; compiling
the block *class* once and reusing the code for each instance costs one compile per
distinct block, whatever the depth, with the same run-time speed-up (PyTorch recipe
"Reducing torch.compile cold start compilation time with regional compilation";
diffusers PR 11837 measured FLUX's compile at 67 s whole against about 10 s by block).

Dynamo caches compiled code per code object and, with ``inline_inbuilt_nn_modules`` (the
default since torch 2.5), lifts a module's parameters to graph inputs, so every block of
one class reuses the first one's graph (a second graph appears only where the inputs
differ in layout, such as FLUX's first single block, which receives a concatenation).

Which blocks: a diffusers model that declares ``_repeated_blocks`` (FLUX, FLUX.2, Qwen-
Image, Wan) is compiled exactly as diffusers' ``compile_repeated_blocks`` does, by those
class names; one that does not (SD3, SANA, the toy) by the classes of the block lists
that are its direct children (``transformer_blocks``: a ``ModuleList`` of one class).

:class:`RegionalCompile` compiles in place (``nn.Module.compile`` semantics: the block's
``_compiled_call_impl``), so weight updates and exploration-copy syncs stay visible. With
``inference_only`` (the training policy's rollouts) a block runs its compiled code only
with gradients off and outside :func:`eager_blocks`, and its eager code in the update's
forwards, which then keep gradient checkpointing and every hook exactly as before.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

_EAGER = threading.local()


@contextlib.contextmanager
def eager_blocks():
    """Every block compiled by :class:`RegionalCompile` runs its eager code inside.

    The update enters it around all its forwards: the policy's (with gradients, eager
    anyway) and the gradient-free ones beside it (the KL reference, the old policy), so
    the update compares forwards of one code path. Outside it a no-grad forward would run
    the compiled blocks and the KL at initialisation would be a compile-vs-eager
    difference instead of exactly 0 (issue 61)."""
    before = getattr(_EAGER, "on", False)
    _EAGER.on = True
    try:
        yield
    finally:
        _EAGER.on = before


def _eager_forced() -> bool:
    return getattr(_EAGER, "on", False)


def repeated_block_classes(model: nn.Module) -> tuple[str, ...]:
    """The class names of ``model``'s repeated blocks: the diffusers declaration
    (``_repeated_blocks``) of ``model`` or of the diffusers models inside it (Wan2.2's
    two experts), else the classes of the one-class ``ModuleList`` children."""
    names: list[str] = []
    for module in model.modules():
        for name in getattr(module, "_repeated_blocks", None) or ():
            if name not in names:
                names.append(name)
    if names:
        return tuple(names)
    for child in model.children():
        if isinstance(child, nn.ModuleList) and len(child) > 0:
            kinds = {type(block).__name__ for block in child}
            if len(kinds) == 1 and (kind := kinds.pop()) not in names:
                names.append(kind)
    return tuple(names)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    classes = repeated_block_classes(model)
    return [m for m in model.modules() if type(m).__name__ in classes]


class RegionalCompile:
    """``module`` with every repeated block compiled in place; calling it calls ``module``.

    ``compile_kwargs`` go to ``torch.compile`` (``fullgraph``, ``mode``, ``backend``).
    ``first_call_s`` is the first call's wall time; ``compile_s`` sums each block's first
    compiled call, which holds its compilation (or its cache hit) and one run, whoever
    made it (an evaluation before the first rollout, say); ``log`` gets one line with it
    after the first call. If compiling fails (no C++ compiler for
    inductor on a CPU, an op dynamo cannot trace under ``fullgraph``), one line says so
    and every block runs eagerly from then on; a genuine error in the model then
    surfaces from the eager call, unchanged. Attribute access reaches ``module``, and
    ``.module`` lets :func:`diffrl.models.base.unwrap` find it.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        inference_only: bool = False,
        log: Callable[[str], None] | None = print,
        label: str = "compile",
        **compile_kwargs,
    ):
        self.module = module
        self.classes = repeated_block_classes(module)
        if not self.classes:
            raise ValueError(
                f"{type(module).__name__} has no repeated blocks to compile (no _repeated_blocks "
                "declaration and no block list child); compile it whole"
            )
        self.blocks = repeated_blocks(module)
        self.compile_kwargs = compile_kwargs
        self.inference_only = inference_only
        self.failed: str | None = None
        self.first_call_s: float | None = None
        self._log, self._label = log, label
        for block in self.blocks:
            self._install(block)

    def _install(self, block: nn.Module) -> None:
        # what nn.Module.compile sets: Module._wrapped_call_impl calls it instead of _call_impl
        block._compiled_call_impl = _BlockCall(self, block._call_impl)

    def _fail(self, err: Exception) -> None:
        self.failed = _reason(err)
        if self._log is not None:
            self._log(
                f"{self._label}: compiling {type(self.module).__name__}'s blocks failed "
                f"({self.failed}); running them eagerly"
            )

    def __call__(self, *args, **kwargs):
        if self.first_call_s is not None:
            return self.module(*args, **kwargs)
        _synchronize()
        start = time.perf_counter()
        out = self.module(*args, **kwargs)
        _synchronize()
        self.first_call_s = time.perf_counter() - start
        if self._log is not None and not self.failed:
            self._log(f"{self._label}: {self.describe()}")
        return out

    @property
    def compile_s(self) -> float:
        return sum(b._compiled_call_impl.first_s or 0.0 for b in self.blocks if _is_ours(b))

    def describe(self) -> str:
        first = (
            "" if self.first_call_s is None else f"; first calls {self.compile_s:.1f} s, compiling included"
        )
        return (
            f"{len(self.blocks)} blocks of {len(self.classes)} kind{'s' * (len(self.classes) > 1)} "
            f"({', '.join(self.classes)}) "
            f"compiled by block{first}"
        )

    def __getattr__(self, name):
        if name == "module":  # not set yet (a copy being built): no recursion through it
            raise AttributeError(name)
        return getattr(self.module, name)


def _is_ours(block: nn.Module) -> bool:
    return isinstance(getattr(block, "_compiled_call_impl", None), _BlockCall)


class _BlockCall:
    """One block's call: compiled, or eager where the owner says so. A deep copy of the
    block (an exploration copy, a KL reference) gets no compiled call, since this one
    runs the original block's weights: ``__deepcopy__`` returns None, the eager default."""

    def __init__(self, owner: RegionalCompile, eager):
        self.owner, self.eager = owner, eager
        self.compiled = torch.compile(eager, **owner.compile_kwargs)
        self.first_s: float | None = None  # the first compiled call's wall time

    def __call__(self, *args, **kwargs):
        owner = self.owner
        if owner.failed or (owner.inference_only and (torch.is_grad_enabled() or _eager_forced())):
            return self.eager(*args, **kwargs)
        try:
            if self.first_s is not None:
                return self.compiled(*args, **kwargs)
            _synchronize()
            start = time.perf_counter()
            out = self.compiled(*args, **kwargs)
            _synchronize()
            self.first_s = time.perf_counter() - start
            return out
        except torch.OutOfMemoryError:
            raise  # a real condition of the run, not a compile failure
        except Exception as err:  # noqa: BLE001 (any compile failure: the eager call re-raises real errors)
            owner._fail(err)
            return self.eager(*args, **kwargs)

    def __deepcopy__(self, memo):
        return None


def _reason(err: BaseException) -> str:
    """``Type: first line`` of the innermost cause (dynamo wraps a backend's own error)."""
    while (inner := getattr(err, "inner_exception", None) or err.__cause__) is not None:
        err = inner
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def _synchronize() -> None:
    """Wait for queued CUDA work, so that a wall time covers it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
