"""Group-relative advantage estimators.

All estimators take the *global* batch (every process's samples, gathered) so that a
group split across ranks is normalised over the whole group.

Std convention (``advantage.std`` and ``advantage.eps``): the default is the population
std (ddof = 0) + 1e-4, as flow_grpo (``flow_grpo/stat_tracking.py``: ``np.std`` and
``+ 1e-4``), whose hyper-parameters most configs here start from. DanceGRPO and BranchGRPO
divide by ``torch.std`` (ddof = 1) + 1e-8; ``std: sample`` with ``eps: 1e-8`` reproduces
them. The two differ by sqrt(G / (G - 1)) in scale (1.07 at G = 8, 1.41 at G = 2) and
in the guard: 1e-8 lets a near-tie group (std 1e-6) produce advantages near +-1
amplified by nothing, where 1e-4 damps it; we keep ddof 0 as the default because a group
of 2 (Sol-RL's best/worst pairs) then gives exactly +-1 at any reward gap.

* ``group``      — GRPO: A = (r - mean_g) / (std_g + eps).
* ``global_std`` — A = (r - mean_g) / (std_batch + eps) (flow_grpo's ``global_std``).
* ``median``     — MC-GRPO (Kim et al. 2025): A = (r - median_g) / (std_g + eps). In an
  odd-sized group the median sample is a pivot with A = 0 and is excluded from backprop.
* ``decoupled``  — GDPO (NVIDIA 2026): A_k = group-normalise each reward component k,
  A_sum = sum_k w_k A_k, then batch-normalise A_sum: (A_sum - mean) / (std + eps).

Groups whose combined reward has zero variance carry no signal; with
``filter_zero_std`` they are masked out, and the fraction filtered is reported.

A group with a non-finite reward (NaN or inf in the combined reward or any component)
is dropped whole: its members get advantage 0 and ``keep`` False, and the estimator runs
on the other groups exactly as if the dropped ones had not been sampled (a NaN would
otherwise poison its group's mean and std, and with ``global_std`` / ``decoupled`` the
whole batch). ``dropped_groups`` / ``dropped_samples`` count them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ESTIMATORS = ("group", "global_std", "median", "decoupled")


@dataclass
class Advantages:
    values: torch.Tensor  # (N,) advantage per sample
    keep: torch.Tensor  # (N,) bool: sample contributes to the loss
    filtered_fraction: float  # fraction of groups dropped for zero variance
    dropped_groups: int = 0  # groups left out for a non-finite reward
    dropped_samples: int = 0  # their members
    clean: torch.Tensor | None = None  # (N,) bool: the sample's group has only finite rewards


def _group_stat(values: torch.Tensor, group_ids: torch.Tensor, fn) -> torch.Tensor:
    """Broadcast a per-group statistic ``fn(group_values)`` back to every member."""
    out = torch.empty_like(values)
    for g in torch.unique(group_ids):
        mask = group_ids == g
        out[mask] = fn(values[mask])
    return out


STD_CONVENTIONS = ("population", "sample")


def _pop_std(x: torch.Tensor) -> torch.Tensor:
    return x.std(unbiased=False) if x.numel() > 1 else x.new_zeros(())


def _sample_std(x: torch.Tensor) -> torch.Tensor:
    """torch.std (ddof 1), as DanceGRPO and BranchGRPO; 0 for a single sample (torch gives NaN)."""
    return x.std(unbiased=True) if x.numel() > 1 else x.new_zeros(())


def _median(x: torch.Tensor) -> torch.Tensor:
    return torch.quantile(x, 0.5)  # true median: mean of the middle pair for even sizes


def _scaled(centred: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    """centred / (std + eps), and exactly 0 where std == 0 (no signal, never NaN)."""
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))


def _group_normalise(r: torch.Tensor, group_ids: torch.Tensor, eps: float, std_fn=_pop_std) -> torch.Tensor:
    return _scaled(r - _group_stat(r, group_ids, torch.mean), _group_stat(r, group_ids, std_fn), eps)


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    estimator: str = "group",
    eps: float = 1e-4,
    filter_zero_std: bool = True,
    components: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    std: str = "population",
) -> Advantages:
    """Advantages for N samples.

    ``rewards`` (N,) is the combined (weighted) reward; ``components`` (N, K) and
    ``weights`` (K,) are the per-reward scores, used by ``decoupled``. ``std`` is
    ``population`` (ddof 0) or ``sample`` (ddof 1), see the module docstring.
    """
    if std not in STD_CONVENTIONS:
        raise ValueError(f"advantage.std must be one of {', '.join(STD_CONVENTIONS)}, got '{std}'")
    std_fn = _pop_std if std == "population" else _sample_std
    r = rewards.double()
    group_ids = torch.as_tensor(group_ids)
    finite = torch.isfinite(r)
    if components is not None:
        finite &= torch.isfinite(components.double()).all(dim=1)
    if not bool(finite.all()):
        return _without_nonfinite_groups(
            r, group_ids, finite, estimator, eps, filter_zero_std, components, weights, std
        )
    if estimator == "group":
        adv = _group_normalise(r, group_ids, eps, std_fn)
    elif estimator == "global_std":
        adv = _scaled(r - _group_stat(r, group_ids, torch.mean), std_fn(r).expand_as(r), eps)
    elif estimator == "median":
        adv = _scaled(r - _group_stat(r, group_ids, _median), _group_stat(r, group_ids, std_fn), eps)
    elif estimator == "decoupled":
        if components is None:
            components, weights = r[:, None], torch.ones(1, dtype=torch.float64)
        comps = components.double()
        w = torch.ones(comps.shape[1], dtype=torch.float64) if weights is None else weights.double()
        summed = sum(
            w[k] * _group_normalise(comps[:, k], group_ids, eps, std_fn) for k in range(comps.shape[1])
        )
        adv = _scaled(summed - summed.mean(), std_fn(summed).expand_as(summed), eps)
    else:
        raise ValueError(f"unknown advantage estimator '{estimator}'; valid: {', '.join(ESTIMATORS)}")

    keep = torch.ones_like(r, dtype=torch.bool)
    if estimator == "median":  # MC-GRPO pivot: exactly-median members of odd groups
        sizes = _group_stat(torch.ones_like(r), group_ids, torch.sum)
        keep &= ~((sizes % 2 == 1) & (r == _group_stat(r, group_ids, _median)))
    zero_var = _group_stat(r, group_ids, _pop_std) == 0
    n_groups = len(torch.unique(group_ids))
    n_zero = len(torch.unique(group_ids[zero_var])) if bool(zero_var.any()) else 0
    if filter_zero_std:
        keep &= ~zero_var
        adv = torch.where(zero_var, torch.zeros_like(adv), adv)
    return Advantages(adv.float(), keep, n_zero / max(n_groups, 1), clean=torch.ones_like(keep))


def _without_nonfinite_groups(
    r, group_ids, finite, estimator, eps, filter_zero_std, components, weights, std
) -> Advantages:
    bad = torch.unique(group_ids[~finite])
    clean = ~torch.isin(group_ids, bad)
    values = torch.zeros(len(r))
    keep = torch.zeros(len(r), dtype=torch.bool)
    filtered = 0.0
    if bool(clean.any()):
        sub = compute_advantages(
            r[clean],
            group_ids[clean],
            estimator,
            eps,
            filter_zero_std,
            None if components is None else components[clean],
            weights,
            std,
        )
        values[clean], keep[clean], filtered = sub.values, sub.keep, sub.filtered_fraction
    return Advantages(
        values, keep, filtered, dropped_groups=len(bad), dropped_samples=int((~clean).sum()), clean=clean
    )
