"""Where is the reward decided? Between-sibling reward variance per denoising step.

A tree rollout (BranchGRPO, arXiv:2509.06040, sec. 3) splits at chosen steps, and an SDE
window (MixGRPO, arXiv:2507.21802; flow_grpo's ``sde_window``) puts noise only on some
steps. Both papers place them by hand. This probe measures where they belong for a given
model, reward and prompt set:

* for each prompt, one root trajectory runs with the deterministic (ODE) rule from a
  seeded initial noise;
* at each step k, ``children`` copies of the root's x_k take the sampler's stochastic step
  at k with independent noise, then finish with the ODE rule; their final images are
  scored by the run's reward;
* the between-sibling variance of that reward (unbiased, over the children) is the reward
  variance that step k's noise alone creates. Its mean over prompts, with the standard
  error over prompts, is reported per step, with each step's share of the sum and the
  cumulative share.

A step with no variance cannot produce a group advantage, so neither a split nor an SDE
step there can teach anything: :func:`recommend` puts the splits at the steps with the
largest variance and the window where a run of consecutive steps holds the most.

A reward made of parts (a verifier's clauses, a weighted sum of rewards) can be decided at
different depths: the total's curve may be dominated by a part the base already gets right
while the part training must fix is decided later. ``scores`` names logged scores of the
reward (its third output, e.g. ``shapeworld_clause/shapes``) whose between-sibling
variance is measured the same way, per step. A score that is undefined for a sample (NaN,
e.g. a clause that only some prompts have) is left out of that prompt's variance; a
prompt with fewer than two defined children is left out of the mean.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from diffrl.sampling.sde import step


@dataclass
class DepthCurve:
    """Per-step results of :func:`probe`: ``variance[k]`` (mean over prompts of the
    between-sibling reward variance when branching at step k) and its standard error."""

    variance: list[float]
    standard_error: list[float]
    mean_reward: list[float]  # the children's mean reward at each branch step
    prompts: int
    children: int
    noise_level: float
    sde_type: str
    scores: dict[str, list[float]] = field(default_factory=dict)  # per-step variance of named parts

    @property
    def share(self) -> list[float]:
        return _shares(self.variance)

    def score_share(self, name: str) -> list[float]:
        """Each step's share of the named score's between-sibling variance."""
        return _shares(self.scores[name])

    @property
    def cumulative_share(self) -> list[float]:
        return _cumulative(self.share)

    def as_dict(self) -> dict:
        return {
            "variance": self.variance,
            "standard_error": self.standard_error,
            "share": self.share,
            "cumulative_share": self.cumulative_share,
            "mean_reward": self.mean_reward,
            "prompts": self.prompts,
            "children": self.children,
            "noise_level": self.noise_level,
            "sde_type": self.sde_type,
            "scores": self.scores,
        }

    @classmethod
    def from_dict(cls, record: dict) -> DepthCurve:
        """The curve of a ``probe.json`` (:meth:`as_dict` plus the run's details)."""
        keys = ("variance", "standard_error", "mean_reward", "prompts", "children", "noise_level", "sde_type")
        return cls(**{k: record[k] for k in keys}, scores=record.get("scores", {}))


def decided_by(shares: list[float], fraction: float) -> int:
    """The first step whose cumulative share reaches ``fraction`` (the last step if none)."""
    reached = (k for k, c in enumerate(_cumulative(shares)) if c >= fraction - 1e-9)  # shares are floats
    return next(reached, len(shares) - 1)


def _cumulative(shares: list[float]) -> list[float]:
    return list(itertools.accumulate(shares))


def _shares(variance: list[float]) -> list[float]:
    total = sum(v for v in variance if math.isfinite(v))
    return [v / total if total > 0 and math.isfinite(v) else 0.0 for v in variance]


def between_sibling_variance(values: torch.Tensor) -> tuple[float, float]:
    """(mean over prompts, standard error) of the unbiased variance over each row of
    ``values`` (prompts, children), NaN entries left out; rows with fewer than two defined
    children are left out. NaN when no row has two."""
    count = (~values.isnan()).sum(dim=1)
    squares = (values - values.nanmean(dim=1, keepdim=True)).pow(2).nansum(dim=1)
    usable = count >= 2  # an all-NaN row's nanmean is NaN, but it is left out here
    per_prompt = squares[usable] / (count[usable] - 1)
    n = per_prompt.numel()
    if n == 0:
        return float("nan"), float("nan")
    error = float(per_prompt.std(unbiased=True) / math.sqrt(n)) if n > 1 else float("nan")
    return float(per_prompt.mean()), error


def _velocity_rows(adapter, transformer, x, sigma: float, cond, batch: int) -> torch.Tensor:
    """The velocity of every row of ``x`` at ``sigma``, ``batch`` rows per forward."""
    parts = []
    for start in range(0, x.shape[0], batch):
        rows = list(range(start, min(start + batch, x.shape[0])))
        sig = torch.full((len(rows),), sigma, device=x.device)
        parts.append(adapter.velocity(transformer, x[rows], sig, cond.select(rows)))
    return torch.cat(parts)


def _run(adapter, transformer, x, cond, sigmas, start: int, first_kind: str, level, sigma_1, gen, batch):
    """From x at step ``start``: one ``first_kind`` step with fresh noise from ``gen``, then
    the ODE rule to the end. Returns the final latents."""
    for t in range(start, len(sigmas) - 1):
        v = _velocity_rows(adapter, transformer, x, float(sigmas[t]), cond, batch)
        kind = first_kind if t == start else "ode"
        noise = None
        if kind != "ode":
            noise = torch.randn(x.shape, generator=gen).to(x.device)
        x = step(kind, x, v, sigmas[t], sigmas[t + 1], level, sigma_1=sigma_1, noise=noise).next_latents
    return x


@torch.no_grad()
def probe(
    adapter,
    transformer,
    reward_fn,
    prompts: list,
    num_steps: int,
    sde_type: str,
    noise_level: float,
    children: int = 8,
    batch: int = 64,
    seed: int = 0,
    scores: tuple[str, ...] = (),
    log=print,
) -> DepthCurve:
    """Branch one ODE trajectory per prompt at every step into ``children`` (see the
    module docstring). ``reward_fn`` is a :class:`rewards.combine.MultiReward`
    (images, prompts) -> (total, components, logs); ``scores`` names entries of ``logs``
    measured per step too. Forward rows: prompts * children * T(T+1)/2."""
    if children < 2:
        raise ValueError(f"children must be at least 2 to measure a variance, not {children}")
    device = adapter.device
    gen = torch.Generator().manual_seed(seed)
    sigmas = adapter.sigmas(num_steps).float()
    sigma_1 = float(sigmas[1])
    p = len(prompts)
    cond = adapter.encode_prompts(prompts)
    x = torch.randn((p, *adapter.latent_shape()), generator=gen).to(device)
    roots = [x]  # the ODE root: x_0 .. x_{T-1}
    for t in range(num_steps - 1):
        v = _velocity_rows(adapter, transformer, x, float(sigmas[t]), cond, batch)
        x = step("ode", x, v, sigmas[t], sigmas[t + 1], noise_level, sigma_1=sigma_1).next_latents
        roots.append(x)
    rows = [i for i in range(p) for _ in range(children)]
    child_cond, child_prompts = cond.select(rows), [prompts[i] for i in rows]
    variance, error, mean_reward = [], [], []
    by_score: dict[str, list[float]] = {name: [] for name in scores}
    for k in range(num_steps):
        start = roots[k][rows]
        final = _run(
            adapter, transformer, start, child_cond, sigmas, k, sde_type, noise_level, sigma_1, gen, batch
        )
        images = torch.cat([adapter.decode(final[i : i + batch]).float() for i in range(0, len(rows), batch)])
        scored = reward_fn(images, child_prompts)
        reward = scored[0].float().reshape(p, children)
        v, e = between_sibling_variance(reward)
        variance.append(v)
        error.append(e)
        mean_reward.append(float(reward.mean()))
        for name in scores:
            by_score[name].append(between_sibling_variance(_logged(scored, name).reshape(p, children))[0])
        log(f"step {k}: between-sibling variance {variance[-1]:.4g} +- {error[-1]:.2g}")
    return DepthCurve(variance, error, mean_reward, p, children, noise_level, sde_type, by_score)


def _logged(scored: tuple, name: str) -> torch.Tensor:
    """The logged score ``name`` of a MultiReward's output, or one error listing the names."""
    logs = scored[2] if len(scored) > 2 else {}
    if name not in logs:
        raise ValueError(f"--scores: the reward logs no '{name}'; it logs {sorted(logs)}")
    return logs[name].float()


@dataclass
class Recommendation:
    split_steps: list[int]
    split_share: float
    window: tuple[int, int]  # [start, end)
    window_share: float
    steps_for_80: int  # the fewest steps (largest first) holding 80% of the variance

    def lines(self) -> list[str]:
        start, end = self.window
        return [
            f"split steps: {self.split_steps} (they create {100 * self.split_share:.0f}% of the "
            f"between-sibling variance): --set tree.split_steps=[{','.join(map(str, self.split_steps))}]",
            f"SDE window: [{start}, {end}) ({100 * self.window_share:.0f}% of the variance): "
            f"--set sampling.sde_window=[{start},{end}]",
            f"{self.steps_for_80} step(s) hold 80% of the variance",
        ]


def recommend(curve: DepthCurve, splits: int = 3, window: int = 4) -> Recommendation:
    """The ``splits`` steps with the largest variance (in step order), and the run of
    ``window`` consecutive steps holding the largest share."""
    share = curve.share
    n = len(share)
    ranked = sorted(range(n), key=lambda k: -share[k])
    chosen = sorted(ranked[: min(splits, n)])
    width = min(window, n)
    best = max(range(n - width + 1), key=lambda s: sum(share[s : s + width]))
    running, needed = 0.0, 0
    for k in ranked:
        if running >= 0.8 - 1e-9:  # shares are floats
            break
        running += share[k]
        needed += 1
    return Recommendation(
        split_steps=chosen,
        split_share=sum(share[k] for k in chosen),
        window=(best, best + width),
        window_share=sum(share[best : best + width]),
        steps_for_80=needed,
    )


def plot(curve: DepthCurve, path, title: str = "") -> None:
    """Bars of the per-step variance with standard-error whiskers; the cumulative share
    on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(len(curve.variance)))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(steps, curve.variance, yerr=curve.standard_error, color="#4c72b0", capsize=3)
    ax.set_xlabel("branch step k (0 = pure noise)")
    ax.set_ylabel("between-sibling reward variance")
    twin = ax.twinx()
    twin.plot(steps, curve.cumulative_share, color="#dd8452", marker="o", label="reward")
    for i, name in enumerate(curve.scores):  # the named parts' cumulative shares, dashed
        twin.plot(
            steps,
            _cumulative(curve.score_share(name)),
            color=f"C{i + 2}",
            linestyle="--",
            marker=".",
            label=name,
        )
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("cumulative share")
    ax.set_title(title or f"{curve.prompts} prompts x {curve.children} children per step")
    if curve.scores:  # below the axes: inside, the legend hides the late steps' bars
        fig.set_figheight(4.4)
        fig.legend(loc="lower center", ncol=2, fontsize=7, frameon=False)
        fig.tight_layout(rect=(0, 0.14, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_many(curves: dict[str, DepthCurve], path, title: str = "") -> None:
    """Several probes on one figure (e.g. two worlds, or a base and its RL checkpoint):
    each step's share of the variance as grouped bars, the cumulative shares as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / max(len(curves), 1)
    twin = ax.twinx()
    for i, (label, curve) in enumerate(curves.items()):
        steps = list(range(len(curve.variance)))
        colour = f"C{i}"
        ax.bar(
            [k + (i - (len(curves) - 1) / 2) * width for k in steps],
            curve.share,
            width,
            color=colour,
            label=label,
        )
        twin.plot(steps, curve.cumulative_share, color=colour, marker="o")
    ax.set_xlabel("branch step k (0 = pure noise)")
    ax.set_ylabel("share of the between-sibling variance (bars)")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("cumulative share (lines)")
    ax.legend(loc="center right", fontsize=8)
    ax.set_title(title or "where the reward is decided")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
