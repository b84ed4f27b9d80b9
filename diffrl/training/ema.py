"""Moving averages of the trainable weights: the EMA a run evaluates (``train.ema_decay``)
and DiffusionNFT's / AWM's old policy, whose decay ramps with the optimizer steps."""

from __future__ import annotations

import contextlib

import torch

from diffrl.runtime.sharding import like, whole


class EMA:
    """Exponential moving average of parameters (used for evaluation when enabled).

    :meth:`update` is called after every applied optimizer step; n counts those steps.
    The average moves after step n when (n + 1) % ``every`` == 0, with decay d(n) =
    min(decay, (1 + n) / (10 + n)) under ``warmup`` (early averages are not dominated by
    the initial weights), else ``decay``; each such update is applied ``repeats`` times.
    This is flow_grpo's and DiffusionNFT's ``EMAModuleWrapper`` (``flow_grpo/ema.py``:
    ``get_current_decay``, ``step``); flow_grpo builds it with decay 0.9 and
    ``update_step_interval`` 8 (``scripts/train_sd3.py``) and calls ``step`` once per
    micro-batch of samples rather than once per optimizer step, so at its 2 micro-batches
    per optimizer step every update lands twice (``repeats`` 2). With the defaults
    (every 1, repeats 1) it is the plain per-step average; toy pretraining uses warm-up.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        decay: float,
        warmup: bool = False,
        every: int = 1,
        repeats: int = 1,
    ):
        if every < 1 or repeats < 1:
            raise ValueError(f"EMA every ({every}) and repeats ({repeats}) must be at least 1")
        self.params = list(params)
        self.decay, self.warmup, self.every, self.repeats = decay, warmup, every, repeats
        self.steps = 0  # optimizer steps seen
        self.updates = 0  # steps at which the average moved
        self.shadow = [p.detach().clone().float() for p in self.params]  # shards under FSDP

    def decay_at(self, step: int) -> float:
        """The decay used after optimizer step ``step`` (1-based)."""
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: count it, and move the average if the schedule says so."""
        self.steps += 1
        if (self.steps + 1) % self.every:
            return
        self.updates += 1
        weight = 1.0 - self.decay_at(self.steps)
        for _ in range(self.repeats):
            for s, p in zip(self.shadow, self.params):
                s.lerp_(p.detach().float(), weight)

    @contextlib.contextmanager
    def swapped_in(self):
        """Temporarily load the EMA weights into the live parameters."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.shadow, self.params):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, p in zip(backup, self.params):
                    p.copy_(b)

    def named_state_dict(self, policy) -> dict[str, torch.Tensor]:
        """The averaged weights by the trainable parameters' names (whole, on the CPU;
        collective under FSDP: every process calls it)."""
        names = [n for n, _ in policy.trainable_named_parameters()]
        if len(names) != len(self.shadow):
            raise ValueError(f"EMA of {len(self.shadow)} tensors, but the policy trains {len(names)}")
        return {n: whole(s).cpu() for n, s in zip(names, self.shadow)}

    def state_dict(self) -> dict:
        """Whole shadows, also under FSDP (collective there; accelerate calls it on every
        process and the main one writes)."""
        return {
            "decay": self.decay,
            "steps": self.steps,
            "updates": self.updates,
            "shadow": [whole(s).cpu() for s in self.shadow],
        }

    def load_state_dict(self, state: dict) -> None:
        self.shadow = [like(s.float(), p.detach().float()) for s, p in zip(state["shadow"], self.params)]
        self.updates = state.get("updates", 0)
        self.steps = state.get("steps", self.updates)  # before the schedule, one update per step


class OldPolicy(EMA):
    """DiffusionNFT's old policy: an EMA of the trainable weights whose decay ramps with
    the number s of optimizer steps completed: 0 while s < ``flat``, then
    min(rate * (s - flat), max) (NVlabs/DiffusionNFT, ``scripts/train_nft_sd3.py:
    return_decay``, evaluated at its ``global_step`` after each epoch's update).
    :meth:`refresh` is called once per iteration, after the update, so within an
    iteration the old policy is fixed; decay 0 makes it the policy that will sample the
    next iteration."""

    def __init__(self, params: list[torch.nn.Parameter], flat: int, rate: float, maximum: float):
        super().__init__(params, decay=0.0)
        self.flat, self.rate, self.maximum = flat, rate, maximum

    def decay_at(self, optimizer_steps: int) -> float:
        return (
            0.0
            if optimizer_steps < self.flat
            else min(self.rate * (optimizer_steps - self.flat), self.maximum)
        )

    @torch.no_grad()
    def refresh(self, optimizer_steps: int) -> None:
        decay = self.decay_at(optimizer_steps)
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), 1.0 - decay)
        self.updates += 1
