"""DiffusionNFT: the loss against a hand computation on small tensors, the direction
of its gradient, and the old policy's decay schedule."""

from types import SimpleNamespace

import pytest
import torch

from diffrl.algorithms import get_objective
from diffrl.algorithms.nft import optimality_probability
from diffrl.algorithms.objective import LossContext, StepBatch
from diffrl.training.ema import OldPolicy


def _setup(adv, beta=0.7, clip=2.0, weights=None):
    x0 = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]])
    eps = torch.tensor([[0.1, 0.3, -0.2], [-1.0, 0.4, 0.6]])
    sigma = torch.tensor(0.4)
    x_t = (1 - sigma) * x0 + sigma * eps
    w = torch.tensor(0.8, requires_grad=True)
    ocfg = SimpleNamespace(args=SimpleNamespace(beta=beta), adv_clip_max=clip, kl_coef=0.0)
    ctx = LossContext(
        policy_velocity=lambda x, s, c: w * x + 1.0,
        reference_velocity=None,
        objective_cfg=ocfg,
        noise_level=0.7,
        old_velocity=lambda x, s, c: 0.5 * x - 0.25,
    )
    batch = StepBatch(
        x_t=x_t,
        x_next=x_t,
        sigma=sigma,
        sigma_next=sigma,
        sigma_1=None,
        kind="ode",
        old_log_prob=torch.zeros(2),
        advantages=torch.tensor(adv),
        cond=None,
        weights=weights,
        x0=x0,
    )
    return ctx, batch, w


def _hand(adv, beta, clip, w=0.8):
    """The same loss written out element by element in float64."""
    x0 = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]]
    eps = [[0.1, 0.3, -0.2], [-1.0, 0.4, 0.6]]
    s = 0.4
    total = 0.0
    for i in range(2):
        xt = [(1 - s) * a + s * e for a, e in zip(x0[i], eps[i])]
        v = [w * x + 1.0 for x in xt]
        vo = [0.5 * x - 0.25 for x in xt]
        pos = [beta * a + (1 - beta) * b for a, b in zip(v, vo)]
        neg = [(1 + beta) * b - beta * a for a, b in zip(v, vo)]
        parts = []
        for pred in (pos, neg):
            err = [x - s * p - y for x, p, y in zip(xt, pred, x0[i])]
            weight = max(sum(abs(e) for e in err) / 3, 1e-5)
            parts.append(sum(e * e for e in err) / 3 / weight)
        a = max(-clip, min(clip, adv[i]))
        r = min(1.0, max(0.0, a / clip / 2 + 0.5))
        total += (r * parts[0] + (1 - r) * parts[1]) * clip / beta
    return total / 2


@pytest.mark.parametrize("adv", [[1.0, -0.5], [3.0, -7.0], [0.0, 0.0]])
def test_nft_loss_equals_hand_computation(adv):
    ctx, batch, _ = _setup(adv)
    loss, stats = get_objective("nft")(ctx, batch)
    assert loss.item() == pytest.approx(_hand(adv, 0.7, 2.0), rel=1e-6)
    assert float(stats["policy_loss"]) == pytest.approx(loss.item())


def test_masked_samples_do_not_count():
    ctx, batch, _ = _setup([1.0, -0.5], weights=torch.tensor([1.0, 0.0]))
    loss, _ = get_objective("nft")(ctx, batch)
    ctx1, batch1, _ = _setup([1.0, -0.5])
    batch1 = StepBatch(
        **{**batch1.__dict__, **{k: getattr(batch1, k)[:1] for k in ("x_t", "x0", "advantages")}}
    )
    alone, _ = get_objective("nft")(ctx1, batch1)
    assert loss.item() == pytest.approx(alone.item(), rel=1e-6)


def test_positive_samples_pull_the_policy_toward_them():
    """r = 1: only the positive term, whose x0-prediction error shrinks along -grad."""
    ctx, batch, w = _setup([5.0, 5.0])
    loss, stats = get_objective("nft")(ctx, batch)
    loss.backward()
    assert float(stats["nft/r"]) == 1.0
    with torch.no_grad():
        w -= 1e-2 * w.grad
    after, _ = get_objective("nft")(ctx, batch)
    assert after.item() < loss.item()


def test_optimality_probability():
    r = optimality_probability(torch.tensor([-9.0, -2.0, 0.0, 1.0, 2.0, 9.0]), 2.0)
    assert r.tolist() == [0.0, 0.0, 0.5, 0.75, 1.0, 1.0]


def test_old_policy_schedule_and_refresh():
    p = torch.nn.Parameter(torch.tensor([0.0]))
    old = OldPolicy([p], flat=2, rate=0.1, maximum=0.25)
    assert [old.decay_at(i) for i in (0, 1, 2, 3, 4, 9)] == pytest.approx([0, 0, 0, 0.1, 0.2, 0.25])
    with torch.no_grad():
        p.fill_(1.0)
    old.refresh(0)  # decay 0: the old policy becomes the current one
    assert old.shadow[0].item() == 1.0
    with torch.no_grad():
        p.fill_(3.0)
    old.refresh(4)  # decay 0.2: 0.2 * 1 + 0.8 * 3
    assert old.shadow[0].item() == pytest.approx(2.6)
    with old.swapped_in():
        assert p.item() == pytest.approx(2.6)
    assert p.item() == 3.0
