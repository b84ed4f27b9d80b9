"""DiffusionNFT on its own (no Sol-RL): two training steps with independent SDE or ODE-only
rollouts and with a tree, where it trains on the leaves."""

import pytest
import torch

from diffrl.config import load_config
from diffrl.training.trainer import Trainer


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("tiny_flux_flowgrpo", ()),
        ("tiny_flux_flowgrpo", ("sampling.sde_type=ode",)),  # no log-probs needed
        ("tiny_flux_branchgrpo", ("tree.width_pruning=none",)),
    ],
)
def test_two_nft_steps_move_the_policy_and_the_old_policy(name, overrides, tmp_path):
    cfg = load_config(
        name,
        [
            f"output_dir={tmp_path}",
            "train.max_steps=2",
            "eval.every=0",
            "checkpoint.every=0",
            "logging.progress_bar=false",
            "objective.name=nft",
            "objective.args.old_decay_rate=0.25",
            *overrides,
        ],
    )
    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    history = trainer.fit()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    now = list(trainer.policy.trainable_parameters())
    assert any(not torch.equal(a, b) for a, b in zip(start, now))
    # the decay follows the optimizer steps completed (DiffusionNFT's global_step): after
    # 2 iterations of k steps each the old policy has lagged with decay 0.25 k, then 0.5 k
    old = trainer.old_policy
    assert old.updates == 2 and old.decay_at(1) == 0.25
    assert trainer.counters.optimizer_steps >= 2
    assert any(not torch.equal(s, p.float()) for s, p in zip(old.shadow, now))
    assert {"nft/positive_loss", "nft/negative_loss", "nft/r"} <= set(history[-1])


def test_nft_sample_with_old_rolls_out_with_the_old_policys_weights(tmp_path):
    cfg = load_config(
        "tiny_toy_flowgrpo",
        [
            f"output_dir={tmp_path}",
            "train.max_steps=1",
            "eval.every=0",
            "checkpoint.every=0",
            "logging.progress_bar=false",
            "objective.name=nft",
            "objective.args.sample_with=old",
        ],
    )
    trainer = Trainer(cfg)
    params = list(trainer.policy.trainable_parameters())
    with torch.no_grad():  # make the old policy differ from the live weights
        for s in trainer.old_policy.shadow:
            s.add_(0.5)
    seen = []
    strategy = trainer.rollouts.strategy

    def spy(*args, **kwargs):
        seen.append([p.detach().clone() for p in params])
        return strategy(*args, **kwargs)

    trainer.rollouts.strategy = spy
    live = [p.detach().clone() for p in params]
    trainer.rollout_and_score(0)
    assert all(torch.equal(a, s.to(a.dtype)) for a, s in zip(seen[0], trainer.old_policy.shadow))
    assert all(torch.equal(a, b) for a, b in zip(live, params))  # the live weights are back


def test_nft_sample_with_old_needs_nft():
    from diffrl.config import ConfigError

    with pytest.raises(ConfigError, match="unknown key 'objective.args.sample_with'"):
        load_config("tiny_toy_flowgrpo", ["objective.args.sample_with=old"])  # flow_grpo has no such key


def test_solrl_explores_and_regenerates_with_the_old_policy(tmp_path):
    """Sol-RL's train_sana.py syncs its exploration and regeneration copies from the decayed
    old adapter: with sample_with old, the copy is synced from the old weights and the
    regeneration runs with them, then the live weights come back."""
    cfg = load_config(
        "tiny_flux_solrl",
        [f"output_dir={tmp_path}", "train.max_steps=1", "eval.every=0", "checkpoint.every=0",
         "logging.progress_bar=false", "objective.name=nft", "objective.args.sample_with=old"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    params = list(trainer.policy.trainable_parameters())
    with torch.no_grad():  # make the old policy differ from the live weights
        for s in trainer.old_policy.shadow:
            s.add_(0.5)
    stage, seen = trainer.rollouts.stage, {}
    sync, regenerate = stage.copy.sync, stage.regenerate

    def spy_sync(transformer):
        seen["sync"] = [p.detach().clone() for p in params]
        return sync(transformer)

    def spy_regenerate(*args, **kwargs):
        seen["regenerate"] = [p.detach().clone() for p in params]
        return regenerate(*args, **kwargs)

    stage.copy.sync, stage.regenerate = spy_sync, spy_regenerate
    live = [p.detach().clone() for p in params]
    trainer.rollout_and_score(0)
    for moment in ("sync", "regenerate"):
        assert all(torch.equal(a, s.to(a.dtype)) for a, s in zip(seen[moment], trainer.old_policy.shadow))
    assert all(torch.equal(a, b) for a, b in zip(live, params))  # the live weights are back
    seen.clear()
    trainer.rollout_and_score(1)  # the old policy moves every iteration: the copy syncs again
    assert "sync" in seen
