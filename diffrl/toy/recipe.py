"""The two levers of a toy pretraining recipe: where sigmas are drawn, and which captions
are shown when (``--sigma-location``, ``--sigma-weights`` and ``--curriculum`` of the
pretraining scripts).

**Sigma density.** A mixture of logit-normal(m_k, 1) densities with weights w_k (SD3,
Esser et al. 2024, Sec. 3.1, with one component). Layout (where an object goes, which way
it moves) is decided at high noise, detail (colour, shape, edges) at low noise: a
component at m = 1.5 trains the first, one at m = 0 the second. One component draws
exactly what ``logit-normal(m, 1)`` always drew, so old runs replay bitwise.

**Curriculum.** Stages of caption-kind weights, each for a number of steps, the last one
until the end: ``"0,0,0,1@1500; 0,0,1,1@1500; 1,1,2,1"`` trains 1500 steps on position
captions only, 1500 on relations and positions, then the mix. Each stage may set its own
sigma density after a ``~`` as locations and optional weights (``"0,0,0,1@1500~1.5;
1,1,2,1~1.5,0/0.7,0.3"``), which makes the density a schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SigmaDensity:
    """A mixture of logit-normal(location, 1) sigma densities."""

    locations: tuple[float, ...] = (0.0,)
    weights: tuple[float, ...] = (1.0,)

    def sample(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """``n`` sigmas in (0, 1). One component draws ``sigmoid(randn + m)`` exactly as
        the single-density code always did; a mixture first draws each sample's component."""
        if len(self.locations) == 1:
            return torch.sigmoid(torch.randn(n, generator=gen) + self.locations[0])
        which = torch.multinomial(torch.tensor(self.weights), n, replacement=True, generator=gen)
        return torch.sigmoid(torch.randn(n, generator=gen) + torch.tensor(self.locations)[which])

    def share_above(self, sigma: float) -> float:
        """Probability mass above ``sigma`` (for logs and docs)."""
        logit = torch.logit(torch.tensor(sigma, dtype=torch.float64))
        normal = torch.distributions.Normal(0.0, 1.0)
        total = sum(self.weights)
        return float(
            sum(w * (1 - normal.cdf(logit - m)) for m, w in zip(self.locations, self.weights)) / total
        )


def parse_density(locations: str, weights: str = "") -> SigmaDensity:
    """``"1.5,0"`` and ``"0.7,0.3"`` (default: equal weights) as a :class:`SigmaDensity`."""
    try:
        locs = tuple(float(x) for x in str(locations).split(","))
        ws = tuple(float(x) for x in weights.split(",")) if weights else (1.0,) * len(locs)
    except ValueError:
        locs, ws = (), ()
    if not locs or len(ws) != len(locs) or min(ws) < 0 or sum(ws) <= 0:
        raise ValueError(
            f"--sigma-location must be one or more numbers (logit-normal locations, e.g. 1.5 or 1.5,0) "
            f"and --sigma-weights as many non-negative weights, got '{locations}' and '{weights}'"
        )
    return SigmaDensity(locs, ws)


@dataclass(frozen=True)
class Stage:
    """``steps`` steps (None: until the end) of caption kinds drawn with ``kind_weights``,
    at ``density`` (None: the run's ``--sigma-location``)."""

    kind_weights: tuple[float, ...]
    steps: int | None = None
    density: SigmaDensity | None = None


def parse_weights(
    text: str, kinds: tuple[str, ...], flag: str = "--kind-weights", min_length: int | None = None
) -> tuple[float, ...]:
    """Comma-separated non-negative weights, one per kind of ``kinds``. With ``min_length``
    the last kinds may be left out (weight 0), so that older commands, written before a kind
    was added, still parse."""
    lengths = range(min_length or len(kinds), len(kinds) + 1)
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        weights = []
    if len(weights) not in lengths or min(weights) < 0 or sum(weights) <= 0:
        count = " or ".join(str(n) for n in lengths)
        raise ValueError(
            f"{flag} must be {count} non-negative numbers for {', '.join(kinds[: lengths[-1]])} "
            f"(for example {','.join(['1'] * len(kinds))}), got '{text}'"
        )
    return tuple(weights) + (0.0,) * (len(kinds) - len(weights))


def parse_curriculum(text: str, kinds: tuple[str, ...]) -> list[Stage]:
    """``"W,W,W,W@STEPS[~DENSITY]; ...; W,W,W,W[~DENSITY]"`` as stages (see the module
    docstring); an empty text is no curriculum. One error names the bad stage."""
    stages = []
    parts = [p.strip() for p in text.split(";") if p.strip()]
    for i, part in enumerate(parts):
        body, _, density = part.partition("~")
        weights, _, steps = body.partition("@")
        try:
            n = int(steps) if steps.strip() else None
            if (n is None) != (i == len(parts) - 1) or (n is not None and n < 1):
                raise ValueError
            stages.append(
                Stage(
                    parse_weights(weights.strip(), kinds, "--curriculum"),
                    n,
                    _stage_density(density) if density.strip() else None,
                )
            )
        except ValueError as err:
            raise ValueError(
                f"--curriculum stage '{part}' is not 'WEIGHTS@STEPS[~LOCATIONS[/WEIGHTS]]' (weights for "
                f"{', '.join(kinds)}; every stage but the last has @STEPS, the last runs to the end), "
                f"e.g. '0,0,0,1@1500; 1,1,2,1'" + (f": {err}" if str(err) else "")
            ) from None
    return stages


def _stage_density(text: str) -> SigmaDensity:
    """``LOCATIONS[/WEIGHTS]`` after a stage's ``~``."""
    locations, _, weights = text.replace(" ", "").partition("/")
    return parse_density(locations, weights)


def stage_at(stages: list[Stage], step: int) -> int:
    """Index of the stage that step ``step`` (1-based) belongs to."""
    end = 0
    for i, stage in enumerate(stages):
        if stage.steps is None:
            return i
        end += stage.steps
        if step <= end:
            return i
    return len(stages) - 1


__all__ = ["SigmaDensity", "Stage", "parse_curriculum", "parse_density", "parse_weights", "stage_at"]
