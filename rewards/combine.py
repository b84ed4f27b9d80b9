"""Weighted multi-reward scoring; each component is kept for logging and GDPO."""

from __future__ import annotations

import torch

import rewards
from rewards.errors import UserError


class RewardPromptError(UserError, ValueError):
    """A prompt list contains prompts a configured reward cannot score."""


def _key(spec) -> str:
    """An entry's name in scores and logs (``RewardSpec.key``: its label, else the reward's
    name); spec-like objects without one go by their name."""
    return getattr(spec, "key", spec.name)


def _check_unique(keys: list[str]) -> None:
    if len(set(keys)) != len(keys):
        raise rewards.RewardArgsError(
            f"rewards: each entry needs its own name, got {keys}; merge the duplicates into one "
            "entry, or give each a distinct `label` (e.g. two `remote` servers)"
        )


def check_reward_specs(specs) -> None:
    """Everything :class:`MultiReward` checks before it builds, with no weights loaded
    (``--dry-run``): each reward once, known names, known argument names."""
    _check_unique([_key(s) for s in specs])
    for s in specs:
        rewards.check(s.name, **dict(s.args))


def check_prompts_without_weights(specs, prompts: list[str], source: str = "prompts") -> None:
    """Every configured reward's prompt check (:func:`rewards.prompt_checker`) with no weights
    loaded: what ``--dry-run``, ``--preflight`` and a run's start check before any model is
    built, so a prompt a reward cannot score stops the run in seconds, not after loading."""
    for s in specs:
        check = rewards.prompt_checker(s.name, **dict(s.args))
        _run_check(check, prompts, source)


def _run_check(check, prompts: list[str], source: str) -> None:
    if check is None or not prompts:
        return
    try:
        check(prompts)
    except ValueError as err:
        raise RewardPromptError(f"{source}: {err}") from None


class MultiReward:
    """Build each configured reward once and combine them: total = sum_k w_k r_k."""

    def __init__(self, specs):
        self.names = [_key(s) for s in specs]  # keys of scores and logs
        self.reward_names = [s.name for s in specs]  # the key each reward returns its score under
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
            _run_check(getattr(model, "check_prompts", None), prompts, source)

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
        for name, reward_name, model in zip(self.names, self.reward_names, self.models):
            if pending and name in pending[0]:
                parts = [chunk[name].result() for chunk in pending]
                out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            else:
                out = model(images, prompts, metadata or {})
            if reward_name not in out:
                raise KeyError(
                    f"reward '{reward_name}' returned keys {sorted(out)}; it must include '{reward_name}'"
                )
            for key, value in _relabel(out, reward_name, name).items():
                logs[key] = value.detach().float().cpu()
            columns.append(logs[name])
        components = torch.stack(columns, dim=1)
        total = (components * self.weights).sum(dim=1)
        return total, components, logs


def _relabel(out: dict, reward_name: str, key: str) -> dict:
    """A labelled entry's scores: the optimised one under the label, the others under
    ``label/score`` so two entries of one reward never overwrite each other's logs."""
    if key == reward_name:
        return out
    return {(key if k == reward_name else f"{key}/{k}"): v for k, v in out.items()}
