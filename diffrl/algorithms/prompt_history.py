"""Per-prompt reward statistics kept across iterations (DDPO's stat tracking, RLCM's advantages).

DDPO (Black et al. 2024, "Training Diffusion Models with Reinforcement Learning", Sec. 4.3
and App. "per-prompt stat tracking") and RLCM (Oertell et al. 2024, which trains with
DDPO's code) normalise each reward by the statistics of the rewards *its prompt* received,
over this and earlier iterations:

    history[p] += this iteration's rewards of prompt p      (the last ``size`` kept)
    A = (r - mean) / (std + eps)                            (population std)

where mean and std are those of history[p] once it holds at least ``min_count`` rewards,
and those of the whole iteration's batch before that. Reference: kvablack/ddpo-pytorch
``ddpo_pytorch/stat_tracking.py`` (``PerPromptStatTracker``), used as is by
Owen-Oertell/rlcm ``lcm_rl_pytorch/util/stat_tracking.py`` with ``stat_buffer_size: 32``,
``stat_min_count: 16`` and eps 1e-6 (``advantage.history_size``,
``advantage.history_min_count``, ``advantage.eps``).

Differences from GRPO's groups (``advantage.estimator: group``): a prompt's baseline
remembers earlier policies' rewards, and a prompt seen fewer than ``min_count`` times is
compared with the whole batch. Non-finite rewards (which the reference would let poison
the statistics) are kept out of the history and the batch statistics, and their samples
get advantage 0 and no loss. The history is part of a checkpoint (``state_dict``), so a
resumed run continues with the same baselines.
"""

from __future__ import annotations

from collections import deque

import torch


class PromptHistory:
    def __init__(self, size: int, min_count: int, eps: float):
        self.size, self.min_count, self.eps = size, min_count, eps
        self.rewards: dict[str, deque] = {}

    def advantages(self, prompts: list[str], rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages (N,) float64, finite (N,) bool) of one iteration's rewards, the
        history updated with them. ``prompts[i]`` is sample i's prompt text."""
        r = rewards.double().cpu()
        finite = torch.isfinite(r)
        batch = r[finite]
        batch_mean = batch.mean() if batch.numel() else r.new_zeros(())
        batch_std = batch.std(unbiased=False) if batch.numel() > 1 else r.new_zeros(())
        out = torch.zeros_like(r)
        rows_of: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            if bool(finite[i]):
                rows_of.setdefault(prompt, []).append(i)
        for prompt, rows in rows_of.items():
            values = r[rows]
            seen = self.rewards.setdefault(prompt, deque(maxlen=self.size))
            seen.extend(values.tolist())
            if len(seen) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                kept = torch.tensor(list(seen), dtype=torch.float64)
                mean, std = kept.mean(), kept.std(unbiased=False)
            out[rows] = (values - mean) / (std + self.eps)
        return out, finite

    def state_dict(self) -> dict:
        return {"size": self.size, "rewards": {p: list(v) for p, v in self.rewards.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rewards = {p: deque(v, maxlen=self.size) for p, v in state["rewards"].items()}
