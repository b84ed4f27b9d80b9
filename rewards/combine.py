"""Weighted multi-reward scoring; each component is kept for logging and GDPO."""

from __future__ import annotations

import torch

import rewards


class RewardPromptError(ValueError):
    """A prompt list contains prompts a configured reward cannot score."""


def _check_unique(names: list[str]) -> None:
    if len(set(names)) != len(names):
        raise rewards.RewardArgsError(
            f"rewards: each reward may appear once, got {names}; merge the duplicates into one entry"
        )


def check_reward_specs(specs) -> None:
    """Everything :class:`MultiReward` checks before it builds, with no weights loaded
    (``--dry-run``): each reward once, known names, known argument names."""
    _check_unique([s.name for s in specs])
    for s in specs:
        rewards.check(s.name, **dict(s.args))


class MultiReward:
    """Build each configured reward once and combine them: total = sum_k w_k r_k."""

    def __init__(self, specs):
        self.names = [s.name for s in specs]
        _check_unique(self.names)
        self.weights = torch.tensor([float(s.weight) for s in specs])
        self.models = [rewards.build(s.name, **dict(s.args)) for s in specs]

    def to(self, device) -> MultiReward:
        """Move every model-based reward to ``device`` (the policy's), so scoring runs where
        the images are; weight-free rewards have no ``to`` and stay on the CPU."""
        for model in self.models:
            if hasattr(model, "to"):
                model.to(device)
        return self

    def check_prompts(self, prompts: list[str], source: str = "prompts") -> None:
        """Let rewards that only understand a prompt grammar reject a prompt list up front
        (one clear error at start-up instead of zero rewards mid-run)."""
        for model in self.models:
            check = getattr(model, "check_prompts", None)
            if check is not None and prompts:
                try:
                    check(prompts)
                except ValueError as err:
                    raise RewardPromptError(f"{source}: {err}") from None

    @property
    def scores_elsewhere(self) -> bool:
        """Some reward scores in another process while the rollout runs (the ``remote`` reward
        with ``overlap``)."""
        return any(getattr(m, "overlaps_rollout", False) for m in self.models)

    def submit(self, images, prompts: list[str]) -> dict:
        """Start scoring one chunk on every reward that scores elsewhere; returns futures by
        reward name, for ``__call__(..., pending=[...])`` once all chunks are rolled out."""
        models = zip(self.names, self.models)
        return {n: m.submit(images, prompts) for n, m in models if getattr(m, "overlaps_rollout", False)}

    def __call__(self, images, prompts, metadata=None, pending: list[dict] | None = None):
        """Returns (total (B,), components (B, K), logs {name: (B,)} with every score).

        ``pending``: the futures of :meth:`submit` for consecutive chunks covering the whole
        batch, in order; those rewards' scores are their concatenation (in-process rewards
        score the whole batch here as always)."""
        logs: dict[str, torch.Tensor] = {}
        columns = []
        for name, model in zip(self.names, self.models):
            if pending and name in pending[0]:
                parts = [chunk[name].result() for chunk in pending]
                out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            else:
                out = model(images, prompts, metadata or {})
            if name not in out:
                raise KeyError(f"reward '{name}' returned keys {sorted(out)}; it must include '{name}'")
            for key, value in out.items():
                logs[key] = value.detach().float().cpu()
            columns.append(logs[name])
        components = torch.stack(columns, dim=1)
        total = (components * self.weights).sum(dim=1)
        return total, components, logs
