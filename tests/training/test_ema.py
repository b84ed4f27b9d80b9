"""policy.EMA against the closed-form average, with and without warm-up."""

import torch

from diffrl.training.ema import EMA


def _run(warmup: bool, values):
    p = torch.nn.Parameter(torch.zeros(3))
    ema = EMA([p], decay=0.9, warmup=warmup)
    for v in values:
        with torch.no_grad():
            p.fill_(v)
        ema.update()
    return ema, p


def test_ema_matches_the_recurrence_with_and_without_warmup():
    values = [1.0, 2.0, 4.0, 8.0]
    for warmup in (False, True):
        expected = 0.0
        for n, v in enumerate(values, 1):
            d = min(0.9, (1 + n) / (10 + n)) if warmup else 0.9
            expected = d * expected + (1 - d) * v
        ema, _ = _run(warmup, values)
        assert torch.allclose(ema.shadow[0], torch.full((3,), expected)), warmup
    assert not torch.allclose(_run(True, values)[0].shadow[0], _run(False, values)[0].shadow[0])


def test_swapped_in_restores_live_weights_and_state_keeps_the_update_count():
    ema, p = _run(True, [1.0, 3.0])
    with ema.swapped_in():
        assert torch.equal(p.data, ema.shadow[0])
    assert torch.equal(p.data, torch.full((3,), 3.0))
    fresh = EMA([p], decay=0.9, warmup=True)
    fresh.load_state_dict(ema.state_dict())
    assert fresh.updates == 2 and torch.equal(fresh.shadow[0], ema.shadow[0])


def _flow_grpo_ema(values_per_step, micro_batches: int, decay=0.9, interval=8):
    """flow_grpo's loop, written out as its scripts/train_sd3.py runs it: ``ema.step(params,
    global_step)`` after every micro-batch of samples, where ``global_step`` counts the
    optimizer steps taken so far (it is incremented at the micro-batch that syncs); the
    EMAModuleWrapper moves when (global_step + 1) % interval == 0 with decay
    min((1 + global_step) / (10 + global_step), decay)."""
    shadow, weights, global_step = 0.0, 0.0, 0
    for value in values_per_step:
        for micro in range(micro_batches):
            if micro == micro_batches - 1:  # the syncing micro-batch applies the step
                weights, global_step = value, global_step + 1
            if (global_step + 1) % interval == 0:
                d = min((1 + global_step) / (10 + global_step), decay)
                shadow += (1 - d) * (weights - shadow)
    return shadow


def test_the_flow_grpo_schedule_matches_its_per_micro_batch_loop():
    """Every 8 steps, warm-up, each update applied once per micro-batch: the shadow after 40
    optimizer steps equals flow_grpo's loop on the same weight sequence, and a plain
    per-step EMA of the same decay does not."""
    values = [float(v) for v in torch.linspace(0.5, 7.0, 40)]
    expected = _flow_grpo_ema(values, micro_batches=2)
    p = torch.nn.Parameter(torch.zeros(2))
    ema = EMA([p], decay=0.9, warmup=True, every=8, repeats=2)
    for v in values:
        with torch.no_grad():
            p.fill_(v)
        ema.update()
    assert torch.allclose(ema.shadow[0], torch.full((2,), expected), rtol=1e-6)
    assert (ema.steps, ema.updates) == (40, 5)  # after steps 7, 15, 23, 31, 39
    plain = EMA([p], decay=0.9)
    plain.shadow[0].zero_()
    for v in values:
        with torch.no_grad():
            p.fill_(v)
        plain.update()
    assert not torch.allclose(plain.shadow[0], ema.shadow[0], rtol=1e-3)


def test_the_schedule_resumes_where_it_stopped():
    """A resumed EMA continues the interval count: 12 steps then 12 more equal 24 straight."""
    values = [float(v) for v in range(1, 25)]

    def run(ema, vals):
        for v in vals:
            with torch.no_grad():
                ema.params[0].fill_(v)
            ema.update()

    straight = EMA([torch.nn.Parameter(torch.zeros(1))], 0.9, True, every=8, repeats=2)
    run(straight, values)
    first = EMA([torch.nn.Parameter(torch.zeros(1))], 0.9, True, every=8, repeats=2)
    run(first, values[:12])
    second = EMA([torch.nn.Parameter(torch.zeros(1))], 0.9, True, every=8, repeats=2)
    second.load_state_dict(first.state_dict())
    run(second, values[12:])
    assert second.steps == 24 and torch.equal(second.shadow[0], straight.shadow[0])
