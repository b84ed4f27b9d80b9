"""``model.init_lora`` (issue 52, item 3): a run or an evaluation starts from a LoRA
trained elsewhere (a diffrl export, a PEFT folder as flow_grpo releases), refuses one of
another shape or alpha, and a resume still loads its checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from diffrl.config import ConfigError
from diffrl.training.trainer import Trainer
from tests.helpers import quick_config

MOVES = ["optim.lr=0.1", "rewards=[{name: jpeg_compressibility}]", "checkpoint.every=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of the tiny toy whose LoRA has moved from zero."""
    out = tmp_path_factory.mktemp("init_lora_source")
    Trainer(quick_config("tiny_toy_flowgrpo", out, *MOVES, "train.ema_decay=0")).fit()
    return out / "checkpoints" / "step-2"


def _lora(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.policy.trainable_named_parameters()}


def test_a_run_starts_from_a_diffusers_export(trained, tmp_path):
    trainer = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path, f"model.init_lora={trained}"))
    start = _lora(trainer)
    saved = load_file(trained / "trainable.safetensors")  # the same weights (no EMA here)
    assert set(start) == set(saved) and any(v.abs().max() > 0 for k, v in start.items() if "lora_B" in k)
    for name, value in saved.items():
        torch.testing.assert_close(start[name], value)
    trainer.fit()  # and trains on from there
    assert any(not torch.equal(start[n], p) for n, p in trainer.policy.trainable_named_parameters())


def test_a_run_starts_from_a_peft_folder(tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model

    from diffrl.models import build_adapter

    cfg = quick_config("tiny_toy_flowgrpo", tmp_path / "run")
    adapter = build_adapter(cfg.model)
    targets = list(adapter.default_lora_targets)
    lora = LoraConfig(r=cfg.model.lora.rank, lora_alpha=cfg.model.lora.alpha, target_modules=targets,
                      init_lora_weights=False)  # fmt: skip
    peft_model = get_peft_model(copy.deepcopy(adapter.transformer), lora)
    peft_model.save_pretrained(tmp_path / "peft")
    trainer = Trainer(
        quick_config("tiny_toy_flowgrpo", tmp_path / "run", f"model.init_lora={tmp_path / 'peft'}")
    )
    theirs = {
        n.removeprefix("base_model.model."): p for n, p in peft_model.named_parameters() if "lora_" in n
    }
    for name, value in _lora(trainer).items():
        torch.testing.assert_close(value, theirs[name].detach())


def test_a_lora_of_another_shape_or_alpha_is_one_clear_error(trained, tmp_path):
    with pytest.raises(
        ConfigError, match=r"trained with lora_alpha 8.0 \(rank 4\).*set model.lora.alpha=8.0"
    ):
        Trainer(
            quick_config("tiny_toy_flowgrpo", tmp_path, f"model.init_lora={trained}", "model.lora.alpha=16")
        )
    with pytest.raises(ConfigError, match="does not fit this config's LoRA"):
        Trainer(
            quick_config(
                "tiny_toy_flowgrpo",
                tmp_path,
                f"model.init_lora={trained}",
                "model.lora.target_modules=[to_q]",
            )
        )


def test_a_resume_loads_its_checkpoint_not_the_initial_lora(trained, tmp_path):
    first = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path, *MOVES, "train.max_steps=1"))
    first.fit()
    resumed = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path, *MOVES, f"model.init_lora={trained}"))
    resumed.resume("latest")
    saved = load_file(tmp_path / "checkpoints" / "step-1" / "trainable.safetensors")
    for name, value in _lora(resumed).items():
        torch.testing.assert_close(value, saved[name])


def test_a_lora_of_another_rank_is_one_line_not_a_traceback(trained, tmp_path):
    """Issue 62, item 2: peft's size-mismatch RuntimeError used to surface (53 lines)."""
    sets = (f"model.init_lora={trained}", "model.lora.rank=8", "model.lora.alpha=8")
    with pytest.raises(ConfigError, match=r"has rank 4 .* model.lora.rank is 8 .*set model.lora.rank=4"):
        Trainer(quick_config("tiny_toy_flowgrpo", tmp_path, *sets))


def test_a_missing_local_lora_fails_the_dry_run_and_a_hub_one_is_in_the_preflight(tmp_path, capsys):
    """Issue 62, item 2: both passed --dry-run and --preflight and failed after the base
    model had loaded."""
    from diffrl.cli import main
    from diffrl.config import load_config
    from diffrl.inference.preflight import gather

    base = ["--config", "tiny_toy_flowgrpo", "--set", f"output_dir={tmp_path}"]
    assert main([*base, "--set", f"model.init_lora={tmp_path / 'nope'}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "model.init_lora" in err and "no such file or folder" in err
    hub = load_config("tiny_toy_flowgrpo", ["model.init_lora=someone/a-lora"])
    needs = [n for n in gather(hub) if "model.init_lora" in n.what]
    assert len(needs) == 1 and needs[0].repo == "someone/a-lora"
