"""The policy's weights: a bf16 full fine-tune keeps fp32 master weights, so an update
of 1e-5 relative size is applied, not rounded away (issue 37, defect 4)."""

import pytest
import torch

from diffrl.config import ConfigError
from diffrl.models import build_adapter
from diffrl.models.policy import Policy
from diffrl.training.trainer import Trainer

BF16_FULL = ("model.dtype=bfloat16", "model.full_finetune=true", "train.mixed_precision=bf16")


def _adam_first_step(params, lr):
    """One AdamW step (no decay) with a fixed random gradient; returns the gradients.
    Adam's first step moves every weight by lr * g / (|g| + eps) = lr * sign(g)
    (Kingma & Ba 2015, Algorithm 1 with bias correction at t = 1)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    torch.optim.AdamW(params, lr=lr, weight_decay=0.0).step()
    return grads


def test_bf16_full_finetune_applies_an_update_of_1e_5_relative_size(tiny_cfg):
    cfg = tiny_cfg("flux", *BF16_FULL)
    adapter = build_adapter(cfg.model)
    policy = Policy(adapter, cfg.model, cfg.seed)
    params = policy.trainable_parameters()
    assert params and all(p.dtype == torch.float32 for p in params)
    assert all(p.dtype == torch.bfloat16 for p in policy.frozen_reference.parameters())
    # the master weights start as the bf16 weights exactly (the upcast is lossless)
    for (_, p), (_, r) in zip(
        policy.transformer.named_parameters(), policy.frozen_reference.named_parameters()
    ):
        assert torch.equal(p.detach(), r.float())
    before = [p.detach().clone() for p in params]
    lr = 1e-5
    grads = _adam_first_step(params, lr)
    for p, b, g in zip(params, before, grads):
        moved = p.detach() - b
        expected = -lr * torch.sign(g.float())
        torch.testing.assert_close(moved, expected, atol=lr * 1e-2, rtol=0)


def test_the_same_update_on_bf16_weights_is_lost(tiny_cfg):
    """Why the master weights matter: the step above, taken on the bf16 weights
    themselves (the old behaviour), leaves almost every weight unchanged."""
    cfg = tiny_cfg("flux", *BF16_FULL)
    adapter = build_adapter(cfg.model)
    params = [p for p in adapter.transformer.parameters() if p.dim() == 2]  # the big matrices
    assert all(p.dtype == torch.bfloat16 for p in params)
    for p in params:
        p.requires_grad_(True)
    before = [p.detach().clone() for p in params]
    _adam_first_step(params, 1e-5)
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before))
    total = sum(p.numel() for p in params)
    assert changed / total < 0.05


def test_bf16_full_finetune_trains_end_to_end(tiny_cfg):
    trainer = Trainer(tiny_cfg("flux", *BF16_FULL, "optim.lr=1e-5", "train.max_steps=1"))
    before = {n: p.detach().clone() for n, p in trainer.policy.trainable_named_parameters()}
    trainer.fit()
    after = dict(trainer.policy.trainable_named_parameters())
    assert all(p.dtype == torch.float32 for p in after.values())
    moved = sum(int((after[n].detach() != b).sum()) for n, b in before.items())
    assert moved / sum(b.numel() for b in before.values()) > 0.5


def test_bf16_full_finetune_without_autocast_is_refused(tiny_cfg):
    with pytest.raises(ConfigError, match="needs train.mixed_precision: bf16"):
        tiny_cfg("flux", "model.dtype=bfloat16", "model.full_finetune=true", "train.mixed_precision=no")


def test_trainable_state_dict_is_host_copies_kept_by_the_writer_only(tiny_cfg):
    """Checkpoint weights are gathered one tensor at a time into host memory, and only
    the process that writes keeps them (issue 37, defect 2)."""
    from diffrl.runtime.sharding import gathered_to_cpu

    cfg = tiny_cfg("flux")
    policy = Policy(build_adapter(cfg.model), cfg.model, cfg.seed)
    live = dict(policy.trainable_named_parameters())
    state = policy.trainable_state_dict()  # one process: it is the main one
    assert list(state) == list(live)
    for name, t in state.items():
        assert t.device.type == "cpu" and torch.equal(t, live[name].detach().cpu())
        assert t.data_ptr() != live[name].data_ptr()  # a copy, not a view of the live weights
    assert policy.trainable_state_dict(keep=False) == {}
    gathered = []
    import diffrl.runtime.sharding as sharding

    original = sharding.whole
    try:
        sharding.whole = lambda t: gathered.append(t) or original(t)
        assert gathered_to_cpu(live.items(), keep=False) == {}
    finally:
        sharding.whole = original
    assert len(gathered) == len(live)  # a non-writer still takes part in every gather
