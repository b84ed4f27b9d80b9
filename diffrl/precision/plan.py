"""The run's low-precision machinery behind one seam, in the manner of torchtitan's model
converters (``torchtitan/components/quantization``: ``convert(model)`` once, before
compilation and parallelisation; ``post_optimizer_hook`` after every step):

* :meth:`PrecisionPlan.convert` once, before the policy is compiled and handed to
  ``accelerate.prepare``: Jet-RL's FP8 flow (``precision: {rollout, train}``,
  :mod:`~diffrl.precision.fp8_flow`) patches the policy's layers in place, and a full
  fine-tune's frozen reference with them; Sol-RL (``solrl``, :mod:`~diffrl.precision.solrl`)
  builds its exploration copy from the whole, unsharded weights;
* :meth:`PrecisionPlan.phase` around the rollouts (``rollout``) and the update's forwards
  (``train``): the FP8 quantizer is on where the config says;
* :meth:`PrecisionPlan.after_optimizer_step`: the exploration copy is stale once the
  policy has moved, and is re-synced before it is next read.

With neither section on, every call is a no-op, so the trainer has no precision branch:
it converts, enters phases and reports optimizer steps whatever the config says, and
takes Sol-RL's rollout stage where :attr:`PrecisionPlan.solrl` exists.
"""

from __future__ import annotations

import contextlib

from diffrl.precision.fp8_flow import Fp8Flow, build_precision_flow
from diffrl.precision.solrl import SolRLSettings, SolRLStage


class PrecisionPlan:
    """What ``cfg.precision`` and ``cfg.solrl`` ask of a run (see the module docstring).
    ``flow`` is the FP8 flow and ``solrl`` Sol-RL's stage once :meth:`convert` ran, or
    None where the config does not ask for them."""

    def __init__(self, cfg, log=print):
        self.precision_cfg = cfg.precision
        self.family = cfg.model.family
        self.solrl_settings = SolRLSettings.of(cfg) if cfg.solrl.enabled else None
        self.log = log
        self.flow: Fp8Flow | None = None
        self.solrl: SolRLStage | None = None

    def convert(self, transformer, reward_fn, reference=None, align_forwards=None, device=None) -> None:
        """Patch ``transformer`` (and a full fine-tune's frozen ``reference``) for the FP8
        flow, and build Sol-RL's exploration copy of it, scored by ``reward_fn``. Call it
        before compiling the transformer (the compiled blocks then trace the patched
        forwards) and before ``accelerate.prepare`` (the copy is made from the whole
        weights). ``align_forwards`` and ``device``: Sol-RL under FSDP (see
        :class:`~diffrl.precision.solrl.SolRLStage`)."""
        self.flow = build_precision_flow(self.precision_cfg, self.family, transformer, self.log, reference)
        if self.solrl_settings is not None:
            self.solrl = SolRLStage(
                self.solrl_settings,
                transformer,
                reward_fn,
                log=self.log,
                align_forwards=align_forwards,
                device=device,
            )

    def phase(self, name: str):
        """``rollout`` or ``train``: the FP8 quantizer on where ``precision`` asks for it."""
        return contextlib.nullcontext() if self.flow is None else self.flow.phase(name)

    def after_optimizer_step(self) -> None:
        """The policy moved: Sol-RL's copy re-syncs before it is next read."""
        if self.solrl is not None:
            self.solrl.mark_stale()
