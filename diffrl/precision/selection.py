"""Contrastive subsets of an exploration pool (Sol-RL, "FP4 Explore, BF16 Train", Sec. 3:
candidate pool, then the highly contrastive subset that is regenerated in BF16).

Each row of ``rewards`` (G, N) is one prompt's pool; a rule returns the (G, k) pool
indices to regenerate, ascending within a row, so that the regenerated samples keep
the pool's order.

* ``best_worst``: the floor(k/2) highest and ceil(k/2) lowest rewards (Sol-RL's top-k
  plus bottom-k: ``train_utils.py: select_best_worst`` takes k // 2 best and the rest
  worst). Ties break by pool index (stable sort), so the choice is deterministic and no
  candidate is taken twice (the reference's two ``topk`` calls may take a tied one twice).
* ``max_variance``: the k-subset whose rewards have the largest variance. For any
  k-subset, moving an interior value outwards raises the variance, so the optimum
  takes j values from the top and k - j from the bottom of the sorted row; every j
  is tried and the first best is kept.
* ``random``: a uniformly random k-subset keyed by (seed, iteration, prompt): the
  ablation control that shows what selection itself buys.

A candidate whose exploration reward is not finite (a reward model's NaN) ranks as its
row's finite median, so the extreme-seeking rules take it last rather than first (a
descending sort puts NaN on top); its regenerated sample is scored again in any case.

Reference: Sol-RL's top-k plus bottom-k selection (NVlabs/Sana, ``sol_rl``) is
``best_worst``; ``max_variance`` and ``random`` are ours.
"""

from __future__ import annotations

import torch

from diffrl.sampling import rng
from rewards.ranking import kendall_tau, spearman_rho

SELECTION_MODES = ("best_worst", "max_variance", "random")


def _extremes(order: torch.Tensor, top: int, bottom: int) -> torch.Tensor:
    """The first ``top`` and last ``bottom`` entries of a descending order."""
    n = order.shape[-1]
    return torch.cat([order[..., :top], order[..., n - bottom :]], -1)


def _best_worst(rewards: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.sort(rewards, dim=1, descending=True, stable=True).indices
    return _extremes(order, k // 2, k - k // 2)


def _max_variance(rewards: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.sort(rewards, dim=1, descending=True, stable=True).indices
    best, best_var = None, None
    for top in range(k + 1):
        cand = _extremes(order, top, k - top)
        var = torch.gather(rewards, 1, cand).var(dim=1, unbiased=False)
        if best is None:
            best, best_var = cand, var
        else:
            better = var > best_var
            best = torch.where(better.unsqueeze(1), cand, best)
            best_var = torch.where(better, var, best_var)
    return best


def _random(rewards: torch.Tensor, k: int, key: tuple) -> torch.Tensor:
    rows = [
        torch.randperm(rewards.shape[1], generator=rng.generator(*key, "select", g))[:k]
        for g in range(rewards.shape[0])
    ]
    return torch.stack(rows)


def _median_for_nonfinite(values: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return values
    median = torch.where(finite, values, torch.nan).nanmedian(dim=1, keepdim=True).values.nan_to_num(0.0)
    return torch.where(finite, values, median.expand_as(values))


def select_subset(rewards: torch.Tensor, k: int, mode: str, key: tuple = (0,)) -> torch.Tensor:
    """(G, k) ascending pool indices per row of ``rewards`` (G, N); ``key`` seeds ``random``
    (the caller passes (seed, iteration, first prompt index))."""
    if mode not in SELECTION_MODES:
        raise ValueError(f"unknown solrl.select '{mode}'; valid: {', '.join(SELECTION_MODES)}")
    g, n = rewards.shape
    if not 1 <= k <= n:
        raise ValueError(f"cannot select {k} of {n} pool candidates per prompt")
    values = _median_for_nonfinite(rewards.detach().double().cpu())
    if mode == "best_worst":
        chosen = _best_worst(values, k)
    elif mode == "max_variance":
        chosen = _max_variance(values, k)
    else:
        chosen = _random(values, k, key)
    return torch.sort(chosen, dim=1).values


def rank_agreement(low: torch.Tensor, high: torch.Tensor) -> dict[str, float]:
    """Mean per-prompt Kendall tau and Spearman rho between the low-precision rewards
    (G, k) of the selected candidates and the BF16 rewards of their regenerations. Rows
    where either side is constant carry no ranking and are left out (nan if all are)."""
    taus = [kendall_tau(x, y) for x, y in zip(low, high)]
    rhos = [spearman_rho(x, y) for x, y in zip(low, high)]

    def mean(values):
        kept = [v for v in values if v == v]
        return sum(kept) / len(kept) if kept else float("nan")

    return {"kendall_tau": mean(taus), "spearman_rho": mean(rhos)}
