"""fp16 training with a gradient scaler (flow_grpo's recipes run ``mixed_precision:
fp16``). accelerate makes the scaler only on CUDA, so these tests give a CPU run a real
``torch.amp.GradScaler`` where accelerate would put one, and autocast stays off: what is
tested is the update's handling of the scale, not fp16 arithmetic."""

import contextlib

import torch
from accelerate import Accelerator
from accelerate.optimizer import patch_optimizer_step

from diffrl.training.trainer import Trainer


class _Fp16Accelerator(Accelerator):
    """Reports fp16 so that ``clip_grad_norm_`` unscales, as on CUDA (accelerate's state is
    a per-process singleton, already made with ``no`` by earlier tests)."""

    @property
    def mixed_precision(self):
        return "fp16"

    def autocast(self, *args, **kwargs):  # fp16 arithmetic on CPU is not what is tested
        return contextlib.nullcontext()


def _give_scaler(trainer, scale: float):
    """A real GradScaler in the places accelerate puts one: the accelerator (backward
    scales the loss, clip_grad_norm_ unscales) and the prepared optimizer (its step)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
    trainer.acc.__class__ = _Fp16Accelerator
    trainer.acc.scaler, trainer.acc.native_amp = scaler, True
    opt = trainer.optimizer  # what AcceleratedOptimizer.__init__ sets up for a scaler
    opt.scaler, opt._accelerate_step_called = scaler, False
    opt._optimizer_original_step_method = opt.optimizer.step
    opt._optimizer_patched_step_method = patch_optimizer_step(opt, opt.optimizer.step)
    return scaler


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.trainable_named_parameters()}


def test_a_scaled_step_is_the_unscaled_step(tiny_cfg):
    """A power-of-two loss scale is exact: the scaled run's weights equal the plain run's."""
    cfg = tiny_cfg("flux", "train.max_steps=1")
    plain = Trainer(cfg)
    plain.fit()
    scaled = Trainer(tiny_cfg("flux", "train.max_steps=1", f"output_dir={cfg.run_dir}-scaled"))
    _give_scaler(scaled, 2.0**10)
    scaled.fit()
    a, b = _params(plain), _params(scaled)
    assert scaled.counters.optimizer_steps == plain.counters.optimizer_steps >= 1
    assert all(torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-7) for n in a)


def test_an_overflow_lowers_the_scale_is_counted_apart_and_trains_on(tiny_cfg):
    """An inf in one step's gradient (the loss finite): nothing applied, the scale halved,
    ``skipped/fp16_overflow`` counted and not ``skipped/nonfinite_loss``, and the next
    step applies."""
    trainer = Trainer(tiny_cfg("flux", "train.max_steps=1", "train.gradient_accumulation=1"))
    scaler = _give_scaler(trainer, 2.0**10)
    first = next(p for p in trainer.policy.trainable_parameters())
    calls = {"n": 0}

    def overflow_once(grad):
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 1 else grad

    first.register_hook(overflow_once)
    before = _params(trainer)
    history = trainer.fit()
    c = trainer.counters
    assert c.skipped_fp16_overflow == 1 and c.skipped_nonfinite_loss == 0
    assert scaler.get_scale() == 2.0**9
    assert c.optimizer_steps >= 1 and history[-1]["skipped/fp16_overflow"] == 1
    after = _params(trainer)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)
