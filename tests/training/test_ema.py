"""policy.EMA against the closed-form average, with and without warm-up."""

import torch

from diffrl.training.policy import EMA


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
