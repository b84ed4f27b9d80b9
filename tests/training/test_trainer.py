"""The training loop on tiny twins: two steps per family, resume equivalence, clear
errors, and the non-finite guard."""

import json

import pytest
import torch

from diffrl.training.trainer import Trainer
from tests.conftest import FAMILIES
from tests.helpers import fit_until_killed


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.trainable_named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_two_steps_change_parameters_with_finite_loss(family, tiny_cfg):
    trainer = Trainer(tiny_cfg(family))
    before = _params(trainer)
    history = trainer.fit()
    after = _params(trainer)
    assert len(history) == 2
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    changed = sum(not torch.equal(before[n], after[n]) for n in before)
    assert changed > 0, "no trainable parameter changed"
    rows = [json.loads(line) for line in (trainer.cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    for key in ("step", "wall_time", "reward/mean", "loss", "approx_kl", "clipfrac"):
        assert key in rows[-1], key
    ckpt = trainer.cfg.run_dir / "checkpoints" / "step-2"
    assert (ckpt / "pytorch_lora_weights.safetensors").is_file() and (ckpt / "optimizer.bin").is_file()
    assert (trainer.cfg.run_dir / "config.yaml").is_file()


def test_resume_equivalence(tiny_cfg, tmp_path):
    """4 uninterrupted steps == 2 steps, killed, then resumed for 2 (params within 1e-6)."""
    overrides = (
        "train.max_steps=4",
        "checkpoint.every=2",
        "optim.scheduler=cosine",
        "optim.warmup_steps=1",
        "train.ema_decay=0.5",
    )
    full = Trainer(tiny_cfg("flux", *overrides, f"output_dir={tmp_path / 'full'}"))
    full.fit()

    killed = Trainer(tiny_cfg("flux", *overrides, f"output_dir={tmp_path / 'killed'}"))
    fit_until_killed(killed, 2)
    resumed = Trainer(tiny_cfg("flux", *overrides, f"output_dir={tmp_path / 'killed'}"))
    resumed.resume("latest")
    assert resumed.step == 2
    resumed.fit()

    a, b = _params(full), _params(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    for s_full, s_res in zip(full.ema.shadow, resumed.ema.shadow):
        torch.testing.assert_close(s_full, s_res, atol=1e-6, rtol=0)
    assert full.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()
    rows = [
        json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows == [1, 2, 3, 4]


def test_unknown_reward_name_fails_before_model_build(tiny_cfg):
    from rewards import UnknownRewardError

    with pytest.raises(UnknownRewardError, match="unknown reward 'pickscor'.*Valid rewards"):
        Trainer(tiny_cfg("flux", "rewards=[{name: pickscor}]"))


def test_missing_prompt_file_is_clear(tiny_cfg):
    from diffrl.data.prompts import PromptFileError

    with pytest.raises(PromptFileError, match="nope.txt' does not exist"):
        Trainer(tiny_cfg("flux", "data.train_prompts=nope.txt"))


def test_nonfinite_loss_skips_the_step_and_counts(tiny_cfg, monkeypatch):
    trainer = Trainer(tiny_cfg("flux", "train.max_steps=1"))
    before = _params(trainer)
    real = trainer.updater.objective

    def poisoned(ctx, batch):
        loss, stats = real(ctx, batch)
        return loss * float("nan"), stats

    trainer.updater.objective = poisoned
    history = trainer.fit()
    assert history[-1]["skipped/nonfinite_loss"] == 1 and history[-1]["optimizer_steps"] == 0
    after = _params(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before), "a non-finite step was applied"


@pytest.fixture
def nan_reward():
    import rewards

    rewards.register("nan_every", "tests.helpers:NanEvery")
    yield
    rewards.unregister("nan_every")


def test_a_nan_reward_drops_its_group_and_trains_on_the_rest(tiny_cfg, nan_reward):
    # 2 prompts x group 4 per iteration (tiny config): NaN on sample 0 of each reward call
    # poisons group 0 only
    trainer = Trainer(
        tiny_cfg(
            "flux",
            "train.max_steps=1",
            "rewards=[{name: nan_every, args: {every: 8}}]",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.batch_size=8",
        )
    )
    before = _params(trainer)
    logged = trainer.fit()[-1]
    assert logged["reward/nonfinite_samples"] == 1 and logged["advantage/dropped_groups"] == 1
    assert logged["optimizer_steps"] > 0 and logged["skipped/nonfinite_reward"] == 0
    assert logged["reward/mean"] is not None  # the finite rewards' mean, not NaN (null in JSON)
    after = _params(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before), "the clean group did not train"


def test_iterations_with_only_nan_rewards_are_said_and_stop_the_run(tiny_cfg, nan_reward, capsys):
    from diffrl.training.watchdog import TrainingStalledError

    trainer = Trainer(
        tiny_cfg(
            "flux",
            "train.max_steps=5",
            "train.max_skipped_iterations=2",
            "rewards=[{name: nan_every, args: {every: 1}}]",
        )
    )
    before = _params(trainer)
    with pytest.raises(
        TrainingStalledError, match=r"2 iteration\(s\) in a row applied no update.*no checkpoint"
    ):
        trainer.fit()
    out = capsys.readouterr().out
    assert "warning: iteration 1 applied no update" in out and "non-finite reward(s)" in out
    assert trainer.step == 2 and trainer.counters.skipped_nonfinite_reward == 2
    after = _params(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_the_cli_ends_a_nan_stalled_run_with_one_line_and_exit_code_2(tiny_cfg, nan_reward, tmp_path, capsys):
    from diffrl.cli import main

    code = main(
        [
            "--config",
            "tiny_flux_flowgrpo",
            "--set",
            f"output_dir={tmp_path / 'r'}",
            "--set",
            "train.max_steps=3",
            "--set",
            "train.max_skipped_iterations=1",
            "--set",
            "eval.every=0",
            "--set",
            "logging.progress_bar=false",
            "--set",
            "rewards=[{name: nan_every, args: {every: 1}}]",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: stopped: 1 iteration(s) in a row") and "Traceback" not in err


def test_evaluation_keys_and_fixed_seeds(tiny_cfg):
    trainer = Trainer(
        tiny_cfg("flux", "eval.every=1", "train.max_steps=1", "eval.seeds=[0, 1]", "eval.train_num_prompts=3")
    )
    first = trainer.evaluate()
    assert set(first) >= {
        "eval/jpeg_incompressibility/mean",
        "eval/jpeg_incompressibility/se",
        "eval/n",
        "eval_train/jpeg_incompressibility/mean",
        "eval_train/jpeg_incompressibility/se",
    }
    assert first["eval/n"] == 2 * min(trainer.cfg.eval.num_prompts, len(trainer.session.eval_prompts))
    assert first["eval_train/n"] == 2 * 3 and len(trainer.session.train_eval_prompts) == 3
    assert first["eval_train/jpeg_incompressibility/mean"] != first["eval/jpeg_incompressibility/mean"]
    assert trainer.evaluate() == first  # same noise, same weights -> same scores


def test_checkpoint_lora_loads_with_diffusers_load_lora_weights(tiny_cfg):
    """The saved LoRA is diffusers-format: a fresh pipeline with load_lora_weights(dir)
    predicts the same velocity as the trained policy."""
    from diffrl.models import build_adapter

    trainer = Trainer(tiny_cfg("flux"))
    trainer.fit()
    fresh = build_adapter(trainer.cfg.model)
    fresh.pipe.load_lora_weights(str(trainer.cfg.run_dir / "checkpoints" / "step-2"))
    cond = trainer.adapter.encode_prompts(["a cat", "a dog"])
    x = torch.randn(2, *trainer.adapter.latent_shape(), generator=torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.6)
    with torch.no_grad():
        trained = trainer.adapter.velocity(trainer.adapter.transformer, x, sigma, cond)
        loaded = fresh.velocity(fresh.transformer, x, sigma, cond)
    torch.testing.assert_close(loaded, trained, atol=1e-5, rtol=1e-4)
    fresh.transformer.disable_lora()
    with torch.no_grad():
        base = fresh.velocity(fresh.transformer, x, sigma, cond)
    assert (base - trained).abs().max() > 1e-6, "LoRA had no effect: the comparison above proves nothing"


def test_full_finetune_uses_frozen_reference(tiny_cfg):
    trainer = Trainer(tiny_cfg("flux", "model.full_finetune=true", "optim.lr=1e-4"))
    assert trainer.policy.frozen_reference is not None
    ref_before = {n: p.clone() for n, p in trainer.policy.frozen_reference.named_parameters()}
    before = _params(trainer)
    history = trainer.fit()
    after = _params(trainer)
    assert sum(not torch.equal(before[n], after[n]) for n in before) > 0
    assert all(torch.equal(ref_before[n], p) for n, p in trainer.policy.frozen_reference.named_parameters())
    assert history[0]["kl"] == 0.0 and history[1]["kl"] > 0.0
    assert (trainer.cfg.run_dir / "checkpoints" / "step-2" / "transformer" / "config.json").is_file()


def test_bf16_autocast_and_gradient_checkpointing_run(tiny_cfg):
    trainer = Trainer(
        tiny_cfg(
            "flux", "train.mixed_precision=bf16", "model.gradient_checkpointing=true", "train.max_steps=1"
        )
    )
    before = _params(trainer)
    history = trainer.fit()
    assert torch.isfinite(torch.tensor(history[-1]["loss"]))
    assert any(not torch.equal(before[n], p) for n, p in _params(trainer).items())


def test_the_process_group_waits_as_long_as_configured(tiny_cfg):
    """torch's 10-minute default is shorter than a first compile or a large checkpoint
    write on another process (issue 37, defect 8): accelerate gets train's timeout."""
    import datetime

    from accelerate.utils import InitProcessGroupKwargs

    from diffrl.config import ConfigError
    from diffrl.training.setup import make_accelerator

    acc = make_accelerator(tiny_cfg("flux", "train.collective_timeout_minutes=90"))
    assert isinstance(acc.init_handler, InitProcessGroupKwargs)  # passed to init_process_group
    assert acc.init_handler.timeout == datetime.timedelta(minutes=90)
    with pytest.raises(ConfigError, match="collective_timeout_minutes must be > 0"):
        tiny_cfg("flux", "train.collective_timeout_minutes=0")
