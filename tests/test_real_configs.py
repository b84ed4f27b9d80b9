"""Every shipped real-model config, proven offline: its algorithm settings (sampler,
steps, tree, Sol-RL, objective, advantages, groups) run one iteration on the family's
tiny twin (``train.py --tiny-twin``), with weight-free rewards in place of model ones."""

import json
from pathlib import Path

import pytest
import torch

from diffrl.config import load_config
from diffrl.training.trainer import Trainer
from diffrl.twin import tiny_twin_overrides

# every shipped config that is neither a tiny twin nor a toy: the real-model ones
REAL = sorted(
    p.stem
    for p in (Path(__file__).resolve().parent.parent / "configs").glob("*.yaml")
    if not p.stem.startswith(("tiny_", "toy_"))
)


@pytest.mark.parametrize("name", REAL)
def test_real_config_runs_one_iteration_on_its_tiny_twin(name, tmp_path):
    real = load_config(name)
    cfg = load_config(
        name, tiny_twin_overrides(real) + [f"output_dir={tmp_path}", "logging.progress_bar=false"]
    )
    # the algorithm is the real config's
    for section in ("sampling", "tree", "solrl", "objective", "advantage"):
        assert getattr(cfg, section) == getattr(real, section), section
    assert (cfg.rollout.group_size, cfg.rollout.strategy) == (real.rollout.group_size, real.rollout.strategy)
    assert len(cfg.rewards) == len(real.rewards) and [r.weight for r in cfg.rewards] == [
        r.weight for r in real.rewards
    ]
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
    from diffrl.training.plan import derive

    assert main(["--config", name, "--full-size", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    nfe = derive(load_config(name))["rollout_nfe_per_iteration"]
    assert f"rollout_nfe_per_iteration {nfe:g}".split() == next(
        line.split() for line in printed.splitlines() if line.strip().startswith("rollout_nfe_per_iteration")
    )


def test_tiny_twin_and_full_size_exclude_each_other(capsys):
    from diffrl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "flux_solrl", "--tiny-twin", "--full-size"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_sd35_flowgrpo_regularises_as_flow_grpo_does_on_its_own_schedule():
    """flow_grpo's beta weighs mean((mu - mu_ref)^2) / (2 std_dev_t^2) with std_dev_t =
    a sqrt(sigma / (1 - sigma)) (1 - sigma_1 at sigma = 1): the config must give that per
    step, not the exact KL, which is 1 / (-dt) times larger."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffrl.sampling.sde import gaussian_kl, step_mean_std

    cfg = load_config("sd35_flowgrpo")
    a, n = cfg.sampling.noise_level, cfg.sampling.num_steps
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3.5's scheduler config
    sched.set_timesteps(n)
    sigmas = sched.sigmas.float()
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 16, generator=gen), torch.randn(2, 16, generator=gen)
    ratios = []
    for t in range(n):
        s, s_next = float(sigmas[t]), float(sigmas[t + 1])
        mu_p, std, std_t = step_mean_std("sde", x, v, s, s_next, a, sigma_1=float(sigmas[1]))
        mu_q, _, _ = step_mean_std("sde", x, 0.9 * v, s, s_next, a, sigma_1=float(sigmas[1]))
        ours = gaussian_kl(mu_p, mu_q, std, std_t, cfg.objective.kl_type)
        denominator = 1 - (float(sigmas[1]) if s == 1.0 else s)
        reference = ((mu_p - mu_q) ** 2).mean(dim=1) / (2 * a**2 * s / denominator)
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=0)
        ratios.append(float(gaussian_kl(mu_p, mu_q, std, std_t, "exact")[0] / reference[0]))
    assert min(ratios) > 3 and max(ratios) > 100  # what kl_type: exact would have done
