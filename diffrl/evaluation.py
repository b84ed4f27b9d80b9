"""Held-out evaluation: fixed prompts x fixed seeds, deterministic ODE sampling.

Noise keys depend only on (prompt index, seed), so every evaluation of a run (and of
any checkpoint) sees exactly the same initial noise.
"""

from __future__ import annotations

import torch

from diffrl.sampling.rollout import rollout_independent


def eval_plan(prompts: list[str], num_prompts: int, seeds: list[int]) -> tuple[list[str], list[tuple]]:
    chosen = prompts[:num_prompts]
    plan_prompts, keys = [], []
    for i, prompt in enumerate(chosen):
        for seed in seeds:
            plan_prompts.append(prompt)
            keys.append(("eval", i, seed))
    return plan_prompts, keys


def _pad_to_multiple(items: list, world: int) -> list:
    missing = (-len(items)) % world
    return items + items[-1:] * missing


@torch.no_grad()
def evaluate(accelerator, adapter, transformer, reward_fn, prompts: list[str], cfg) -> dict[str, float]:
    """Mean of every reward score over the eval set, as ``eval/<name>/mean``."""
    plan_prompts, keys = eval_plan(prompts, cfg.eval.num_prompts, cfg.eval.seeds)
    n = len(keys)
    world, rank = accelerator.num_processes, accelerator.process_index
    padded_p, padded_k = _pad_to_multiple(plan_prompts, world), _pad_to_multiple(keys, world)
    per = len(padded_k) // world
    local_p, local_k = padded_p[rank * per:(rank + 1) * per], padded_k[rank * per:(rank + 1) * per]
    steps = cfg.sampling.eval_num_steps or cfg.sampling.num_steps
    cond = adapter.encode_prompts(local_p)
    with accelerator.autocast():
        traj = rollout_independent(adapter, transformer, cond, local_k, cfg, num_steps=steps, kinds=["ode"] * steps)
    _, _, logs = reward_fn(traj.images, local_p, {"keys": local_k})
    names = sorted(logs)
    local = torch.stack([logs[k] for k in names], dim=1).to(accelerator.device)
    gathered = accelerator.gather(local)[:n]
    return {f"eval/{name}/mean": float(gathered[:, j].mean()) for j, name in enumerate(names)}
