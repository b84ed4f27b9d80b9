"""PromptRL in the loop: the refiner rewrites, the flow model renders the rewrite, the
reward judges the original prompt, both models train from the same advantages, and the
refiner is checkpointed, resumed and evaluated with the run."""

from __future__ import annotations

import types

import pytest
import torch

from diffrl.config import ConfigError, load_config
from diffrl.inference.session import session_for_checkpoint
from diffrl.models.refiner import PromptRefiner
from diffrl.schema.refiner import RefinerConfig
from diffrl.training.data import plan_step
from diffrl.training.refiner_update import RefinerUpdater
from diffrl.training.rollouts import with_format_reward
from diffrl.training.trainer import Trainer
from tests.helpers import fit_until_killed, quick_config

# the shipped ShapeWorld base (its rewards vary, so advantages do), cut small
SMALL = (
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.batch_size=8",
    "train.micro_batch_size=4",
    "sampling.num_steps=4",
    "sampling.sde_window=[0,2]",
    "refiner.model=tiny",
    "refiner.template=plain",
    "refiner.max_new_tokens=6",
    "refiner.lr=1e-2",
)


def _weights(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_one_joint_iteration_renders_rewrites_judges_originals_and_trains_both(tmp_path):
    trainer = Trainer(quick_config("toy_flowgrpo", tmp_path, *SMALL))
    flow, lm = (
        _weights(trainer.policy.trainable_parameters()),
        _weights(trainer.refiner.trainable_parameters()),
    )
    r = trainer.rollout_and_score(0)
    plan = plan_step(trainer.session.train_prompts, trainer.cfg.seed, 0, 2, 4)
    assert r.rewrites is not None and len(r.rewrites.texts) == 8
    assert r.rewrites.texts != plan.prompts  # a random twin never writes the caption back
    total, _, _ = trainer.reward_fn(r.traj.images, plan.prompts, {"keys": plan.keys})
    torch.testing.assert_close(r.total, total)  # judged against the prompts as written
    assert float(r.total.std()) > 0
    metrics = trainer.train_step(0)
    assert not _same(flow, trainer.policy.trainable_parameters())
    assert not _same(lm, trainer.refiner.trainable_parameters())
    assert metrics["refiner/optimizer_steps"] == 1 and metrics["skipped/refiner_nonfinite"] == 0
    assert metrics["refiner/tokens_per_rewrite"] > 0


def test_the_refiner_alone_trains_with_the_flow_model_frozen(tmp_path):
    """UniRL's JOINT=false: refiner.train_flow false."""
    trainer = Trainer(quick_config("toy_flowgrpo", tmp_path, *SMALL, "refiner.train_flow=false"))
    flow, lm = (
        _weights(trainer.policy.trainable_parameters()),
        _weights(trainer.refiner.trainable_parameters()),
    )
    trainer.train_step(0)
    assert _same(flow, trainer.policy.trainable_parameters())
    assert not _same(lm, trainer.refiner.trainable_parameters())


def test_killed_and_resumed_both_models_end_as_the_uninterrupted_run_and_evaluate_from_the_checkpoint(
    tmp_path,
):
    overrides = (*SMALL, "train.max_steps=4", "checkpoint.every=2")
    full = Trainer(quick_config("toy_flowgrpo", tmp_path / "full", *overrides))
    full.fit()
    killed = Trainer(quick_config("toy_flowgrpo", tmp_path / "killed", *overrides))
    fit_until_killed(killed, 2)
    resumed = Trainer(quick_config("toy_flowgrpo", tmp_path / "killed", *overrides))
    resumed.resume("latest")
    assert resumed.refiner_updater.steps == 2
    assert _same(resumed.refiner.trainable_parameters(), killed.refiner.trainable_parameters())
    resumed.fit()
    assert _same(full.refiner.trainable_parameters(), resumed.refiner.trainable_parameters())
    assert _same(full.policy.trainable_parameters(), resumed.policy.trainable_parameters())
    # a checkpoint evaluates with its trained refiner: the same greedy rewrites as the run's
    step = tmp_path / "full" / "checkpoints" / "step-4"
    assert (step / "refiner" / "adapter_config.json").is_file()
    session = session_for_checkpoint(step)
    prompts = ["a red circle", "two blue squares"]
    keys = [("eval", 0), ("eval", 1)]
    assert (
        session.refiner.rewrite(prompts, keys, greedy=True).texts
        == full.refiner.rewrite(prompts, keys, greedy=True).texts
    )
    # exported with the flow model's LoRA, the refiner loads with peft as users load it
    from peft import PeftModel

    from diffrl.models.refiner import tiny_refiner_lm
    from tests.helpers import load_script

    out = load_script("export").export(step, tmp_path / "exported")
    base, _ = tiny_refiner_lm()
    loaded = PeftModel.from_pretrained(base, out / "refiner").eval()
    ids = full.refiner.rewrite(prompts, keys, greedy=True).sequences
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, full.refiner.lm(input_ids=ids).logits)


def test_the_format_reward_pays_tagged_answers_and_gives_kept_originals_their_group_mean():
    rewrites = types.SimpleNamespace(
        formatted=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]),
        trained=torch.tensor([False, True, True, False, True, True]),
    )
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    total, logs = with_format_reward(torch.zeros(6), {}, rewrites, groups, RefinerConfig(format_reward=0.5))
    torch.testing.assert_close(total, 0.5 * torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0, 0.0]))
    assert torch.isnan(logs["refiner_format"][0]) and float(logs["refiner_format"][4]) == 1.0


def test_grpo_on_the_refiner_raises_the_probability_of_rewrites_with_positive_advantage():
    """A reward for saying 'red': after 15 GRPO steps the LM says it in most samples. (The
    whole twin trains: its random logits are so flat that a LoRA below its tied output
    layer moves them little.)"""
    settings = RefinerConfig(
        model="tiny", template="plain", max_new_tokens=4, lr=3e-2, kl_coef=0.0, lora_rank=0
    )
    refiner = PromptRefiner.build(settings)
    acc = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    updater = RefinerUpdater(acc, refiner, settings, micro_batch_size=32, max_grad_norm=1.0)
    prompts = ["a red circle"] * 32

    def red_share(step):
        r = refiner.rewrite(prompts, [(step, 0, 0, i) for i in range(32)])
        reward = torch.tensor([float("red" in t.split()) for t in r.texts])
        return r, reward

    _, before = red_share(-1)
    for step in range(15):
        r, reward = red_share(step)
        adv = (reward - reward.mean()) / (reward.std() + 1e-4)
        updater.run(r, adv, torch.ones(32, dtype=torch.bool))
    _, after = red_share(100)
    assert float(before.mean()) < 0.3 and float(after.mean()) > 0.6


@pytest.mark.parametrize(
    "sets, words",
    [
        (
            ("refiner.model=tiny", "rollout.strategy=tree", "tree.split_steps=[0,1]"),
            "rollout.strategy: independent",
        ),
        (("refiner.model=tiny", "refiner.keep_original=4"), "keep fewer originals"),
        (("refiner.train_flow=false",), "need a refiner"),
        (("refiner.model=tiny", "refiner.train=false", "refiner.train_flow=false"), "nothing would train"),
    ],
)
def test_refiner_settings_that_cannot_work_are_refused_at_load(sets, words):
    with pytest.raises(ConfigError, match=words):
        load_config("tiny_toy_flowgrpo", list(sets))
