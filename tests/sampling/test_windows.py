"""SDE window placement: fixed, sliding (MixGRPO) and random (Flow-GRPO-Fast)."""

from collections import Counter

import pytest
import torch

from diffrl.config import ConfigError, load_config
from diffrl.models import build_adapter
from diffrl.sampling import rollout_independent, rollout_tree
from diffrl.sampling.windows import sde_window_at


def _sampling(**overrides):
    cfg = load_config("tiny_toy_flowgrpo", [f"sampling.{k}={v}" for k, v in overrides.items()])
    return cfg


def test_a_random_window_covers_every_start_flow_grpo_allows_and_no_other():
    """flow_grpo's fast geneval recipe: 10 steps, window of 3 placed in (0, 5): starts 0..2,
    each about a third of the time, the size always 3, the same draw for the same
    (seed, iteration) and a different sequence for another seed."""
    cfg = _sampling(num_steps=10, sde_window="[0, 3]", sde_window_range="[0, 5]")
    windows = [sde_window_at(cfg.sampling, 10, i, seed=42) for i in range(900)]
    starts = Counter(s for s, _ in windows)
    assert set(starts) == {0, 1, 2} and all(e - s == 3 for s, e in windows)
    assert all(abs(n - 300) < 60 for n in starts.values()), starts  # about 6 binomial std
    assert windows == [sde_window_at(cfg.sampling, 10, i, seed=42) for i in range(900)]
    assert windows != [sde_window_at(cfg.sampling, 10, i, seed=43) for i in range(900)]


def test_fixed_and_sliding_windows_are_unchanged():
    fixed = _sampling(num_steps=10, sde_window="[2, 4]")
    assert [sde_window_at(fixed.sampling, 10, i) for i in (0, 7)] == [(2, 4), (2, 4)]
    sliding = _sampling(num_steps=10, sde_window="[0, 2]", sde_window_slide_every=2)
    assert [sde_window_at(sliding.sampling, 10, i) for i in (0, 2, 4, 100)] == [
        (0, 2),
        (1, 3),
        (2, 4),
        (8, 10),
    ]


@pytest.mark.parametrize("sampler", [rollout_independent, rollout_tree])
def test_rollouts_take_the_iterations_random_window(sampler):
    """Both samplers put the SDE exactly where the draw for (seed, iteration) says (a
    tree also keeps its split steps stochastic)."""
    cfg = load_config(
        "tiny_toy_flowgrpo",
        [
            "sampling.num_steps=6",
            "sampling.sde_window=[0, 2]",
            "sampling.sde_window_range=[0, 6]",
            "rollout.group_size=2",
            "tree.split_steps=[0]",
            "tree.branch_factors=[2]",
        ],
    )
    adapter = build_adapter(cfg.model)
    keys = [(cfg.seed, 0, 0, s) for s in range(2)]
    cond = adapter.encode_prompts(["a red circle"] * 2)
    seen = set()
    for iteration in range(6):
        start, end = sde_window_at(cfg.sampling, 6, iteration, seed=cfg.seed)
        traj = sampler(adapter, adapter.transformer, cond, keys, cfg, iteration=iteration)
        sde = {t for t, k in enumerate(traj.step_kinds) if k != "ode"}
        splits = {0} if sampler is rollout_tree else set()
        assert sde == set(range(start, end)) | splits
        seen.add(start)
        assert bool(torch.isfinite(traj.latents).all())
    assert len(seen) > 1  # six iterations did not all draw the same start


@pytest.mark.parametrize(
    "overrides",
    [
        {"sde_window_range": "[0, 5]"},  # no window to place
        {"sde_window": "[0, 3]", "sde_window_range": "[0, 2]"},  # no room
        {"sde_window": "[0, 3]", "sde_window_range": "[0, 5]", "sde_window_slide_every": 2},
    ],
)
def test_an_impossible_random_window_is_one_clear_error(overrides):
    with pytest.raises(ConfigError, match="sampling.sde_window"):
        _sampling(num_steps=10, **overrides)
