"""Samplers read only their own settings: the sampling and tree sections, the rollout
batch size and the log-prob convention (diffrl/sampling/settings.py)."""

import torch

from diffrl.config import load_config
from diffrl.models import build_adapter
from diffrl.sampling import SamplerSettings, rollout_independent, rollout_tree


def test_rollouts_from_the_narrowed_settings_equal_rollouts_from_the_whole_config():
    cfg = load_config(
        "tiny_toy_flowgrpo", ["rollout.group_size=4", "tree.split_steps=[0, 1]", "tree.branch_factors=[2]"]
    )
    settings = SamplerSettings.of(cfg)
    assert not hasattr(settings, "objective") and SamplerSettings.of(settings) is settings
    adapter = build_adapter(cfg.model)
    keys = [(0, 0, 0, s) for s in range(4)]
    cond = adapter.encode_prompts(["a red circle"] * 4)
    for sampler in (rollout_independent, rollout_tree):
        whole = sampler(adapter, adapter.transformer, cond, keys, cfg)
        narrow = sampler(adapter, adapter.transformer, cond, keys, settings)
        assert torch.equal(whole.latents, narrow.latents) and torch.equal(whole.log_probs, narrow.log_probs)
