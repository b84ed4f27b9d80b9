"""Rank correlations of two 1-D samples, with ties handled (used to compare reward models
in ``rewards.bench`` and low- against high-precision rewards in Sol-RL)."""

from __future__ import annotations

import torch


def kendall_tau(a: torch.Tensor, b: torch.Tensor) -> float:
    """Kendall's tau-b of two 1-D samples (ties corrected); nan when either is constant."""
    a, b = a.double().flatten(), b.double().flatten()
    da = torch.sign(a.unsqueeze(0) - a.unsqueeze(1))
    db = torch.sign(b.unsqueeze(0) - b.unsqueeze(1))
    upper = torch.triu(torch.ones_like(da, dtype=torch.bool), diagonal=1)
    s = (da * db)[upper].sum()
    na, nb = (da[upper] != 0).sum(), (db[upper] != 0).sum()
    if na == 0 or nb == 0:
        return float("nan")
    return float(s / torch.sqrt(na.double() * nb.double()))


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n with ties given their average rank."""
    x = x.double().flatten()
    less = (x.unsqueeze(0) < x.unsqueeze(1)).sum(1).double()
    equal = (x.unsqueeze(0) == x.unsqueeze(1)).sum(1).double()
    return less + (equal + 1) / 2


def spearman_rho(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho: the Pearson correlation of average ranks; nan when either is constant."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = torch.sqrt((ra * ra).sum() * (rb * rb).sum())
    if den == 0:
        return float("nan")
    return float((ra * rb).sum() / den)
