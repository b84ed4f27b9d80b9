"""DDPO's per-prompt stat tracking (RLCM's advantages), against an oracle written from the
description in DDPO's paper and code: numpy, one prompt at a time, a plain list per prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffrl.algorithms.prompt_history import PromptHistory


def _oracle(history: dict, prompts, rewards, size, min_count, eps):
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    out = np.empty_like(rewards)
    for prompt in np.unique(prompts):
        mine = rewards[prompts == prompt]
        history[prompt] = (history.get(prompt, []) + list(mine))[-size:]
        pool = history[prompt] if len(history[prompt]) >= min_count else rewards
        out[prompts == prompt] = (mine - np.mean(pool)) / (np.std(pool) + eps)
    return out


def test_advantages_follow_ddpo_s_tracker_over_many_iterations():
    gen = np.random.default_rng(0)
    tracker, oracle = PromptHistory(size=6, min_count=4, eps=1e-6), {}
    names = ["a red circle", "two squares", "a blue star"]
    for _ in range(12):
        prompts = list(gen.choice(names, size=7))
        rewards = gen.normal(size=7)
        got, finite = tracker.advantages(prompts, torch.tensor(rewards))
        want = _oracle(oracle, prompts, rewards, 6, 4, 1e-6)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
        assert bool(finite.all())
    assert all(len(tracker.rewards[p]) == 6 for p in names)  # the buffers filled and rolled


def test_a_new_prompt_is_compared_with_the_batch_until_it_has_min_count_rewards():
    tracker = PromptHistory(size=32, min_count=3, eps=0.0)
    rewards = torch.tensor([1.0, 3.0, 5.0, 7.0])
    got, _ = tracker.advantages(["p", "p", "q", "q"], rewards)
    batch = (rewards.double() - 4.0) / rewards.double().std(unbiased=False)
    torch.testing.assert_close(got, batch)
    got, _ = tracker.advantages(["p", "p"], torch.tensor([2.0, 2.0]))  # p now has 4 rewards: 1, 3, 2, 2
    seen = torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(
        got, (torch.full((2,), 2.0, dtype=torch.float64) - seen.mean()) / seen.std(unbiased=False)
    )


def test_non_finite_rewards_stay_out_of_the_history_and_get_no_advantage():
    tracker = PromptHistory(size=8, min_count=1, eps=1e-6)
    got, finite = tracker.advantages(["p", "p", "p"], torch.tensor([1.0, float("nan"), 3.0]))
    assert finite.tolist() == [True, False, True] and got[1] == 0 and torch.isfinite(got).all()
    assert list(tracker.rewards["p"]) == [1.0, 3.0]


def test_the_history_survives_a_state_dict_round_trip():
    a = PromptHistory(size=4, min_count=2, eps=1e-6)
    a.advantages(["p", "q", "p"], torch.tensor([1.0, 2.0, 4.0]))
    b = PromptHistory(size=4, min_count=2, eps=1e-6)
    b.load_state_dict(a.state_dict())
    step = (["p", "q", "q"], torch.tensor([0.5, 1.5, 2.5]))
    torch.testing.assert_close(a.advantages(*step)[0], b.advantages(*step)[0])
    assert b.rewards["p"].maxlen == 4


@pytest.mark.parametrize(
    "sets, words",
    [
        (
            ["advantage.estimator=prompt_history"],
            "needs rollout.strategy independent",
        ),
        (["objective.name=rlcm"], "set sampling.sde_type consistency"),
        (["objective.name=rlcm", "sampling.sde_type=consistency", "objective.kl_coef=0.01"], "no KL term"),
        (["sampling.sde_type=consistency", "sampling.num_steps=1"], "set sampling.num_steps to 2 or more"),
    ],
)
def test_rlcm_settings_that_cannot_work_are_refused_at_load(sets, words):
    from diffrl.config import ConfigError, load_config

    name = "tiny_flux_solrl" if sets == ["advantage.estimator=prompt_history"] else "tiny_toy_flowgrpo"
    with pytest.raises(ConfigError, match=words):
        load_config(name, sets)
