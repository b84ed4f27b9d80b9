"""Every shipped real-model config, proven offline: its algorithm settings (sampler,
steps, tree, Sol-RL, objective, advantages, groups) run one iteration on the family's
tiny twin (``train.py --tiny-twin``), with weight-free rewards in place of model ones."""

import json

import pytest
import torch

from diffrl.config import load_config
from diffrl.trainer import Trainer
from diffrl.twin import tiny_twin_overrides

REAL = ["flux_flowgrpo", "flux_branchgrpo", "flux_solrl", "sd35_flowgrpo", "sd35_solrl", "sana_solrl",
        "wan_branchgrpo"]


@pytest.mark.parametrize("name", REAL)
def test_real_config_runs_one_iteration_on_its_tiny_twin(name, tmp_path):
    real = load_config(name)
    cfg = load_config(name, tiny_twin_overrides(real) + [f"output_dir={tmp_path}", "logging.progress_bar=false"])
    # the algorithm is the real config's
    for section in ("sampling", "tree", "solrl", "objective", "advantage"):
        assert getattr(cfg, section) == getattr(real, section), section
    assert (cfg.rollout.group_size, cfg.rollout.strategy) == (real.rollout.group_size, real.rollout.strategy)
    assert len(cfg.rewards) == len(real.rewards) and [r.weight for r in cfg.rewards] == [r.weight for r in real.rewards]
    history = Trainer(cfg).fit()
    row = history[-1]
    assert torch.isfinite(torch.tensor(row["loss"])) and row["optimizer_steps"] >= 1
    if real.solrl.enabled:
        assert row["solrl/explore_nfe"] > 0 and "solrl/kendall_tau" in row


def test_tiny_twin_keeps_weight_free_rewards_and_swaps_model_ones():
    overrides = tiny_twin_overrides(load_config("wan_branchgrpo"))
    rewards = json.loads(next(o for o in overrides if o.startswith("rewards=")).split("=", 1)[1])
    assert rewards[0]["name"] == "video_frames" and rewards[0]["args"]["reward"] == "jpeg_compressibility"
    assert rewards[1]["name"] == "jpeg_compressibility" and rewards[1]["weight"] == 0.5


@pytest.mark.parametrize("name", REAL)
def test_full_size_dry_run_keeps_the_real_plan(name, capsys):
    """``train.py --full-size --dry-run``: the published architecture on random weights, the
    config's own arithmetic (resolution, batches, NFE), and nothing built or downloaded."""
    from diffrl.cli import main
    from diffrl.plan import derive

    assert main(["--config", name, "--full-size", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    nfe = derive(load_config(name))["rollout_nfe_per_iteration"]
    assert f"rollout_nfe_per_iteration {nfe:g}".split() == next(
        line.split() for line in printed.splitlines() if line.strip().startswith("rollout_nfe_per_iteration"))


def test_tiny_twin_and_full_size_exclude_each_other(capsys):
    from diffrl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "flux_solrl", "--tiny-twin", "--full-size"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
