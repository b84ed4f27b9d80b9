"""DiffusionNFT on its own (no Sol-RL): two training steps with independent SDE or ODE-only
rollouts and with a tree, where it trains on the leaves."""

import pytest
import torch

from diffrl.config import load_config
from diffrl.trainer import Trainer


@pytest.mark.parametrize("name,overrides", [
    ("tiny_flux_flowgrpo", ()),
    ("tiny_flux_flowgrpo", ("sampling.sde_type=ode",)),  # no log-probs needed
    ("tiny_flux_branchgrpo", ("tree.width_pruning=none",)),
])
def test_two_nft_steps_move_the_policy_and_the_old_policy(name, overrides, tmp_path):
    cfg = load_config(name, [f"output_dir={tmp_path}", "train.max_steps=2", "eval.every=0", "checkpoint.every=0",
                             "logging.progress_bar=false", "objective.name=nft", "objective.nft_old_decay_rate=0.25",
                             *overrides])
    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    history = trainer.fit()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    now = list(trainer.policy.trainable_parameters())
    assert any(not torch.equal(a, b) for a, b in zip(start, now))
    # decay 0 after iteration 0 (old = current then), 0.25 after iteration 1
    old = trainer.old_policy
    assert old.updates == 2 and old.decay_at(1) == 0.25
    assert any(not torch.equal(s, p.float()) for s, p in zip(old.shadow, now))
    assert {"nft/positive_loss", "nft/negative_loss", "nft/r"} <= set(history[-1])
