"""The run's guard against reward hacking: after each evaluation, the rules of ``guard`` over
the gold panel (``eval/gold/...``) and the monitors (``eval/monitor/...``) warn, mark the
best checkpoint and may stop the run (docs/TRAINING.md, "Guarding against reward hacking").

Each rule compares an evaluation with the run's first one (``eval.at_start`` makes that the
base model's; otherwise the first evaluation it has):

* **gold falls while the trained reward rises** (``gold_drop_se: k``): a gold reward's mean
  has fallen from its best evaluation so far by more than ``k`` standard errors of the
  difference, ``sqrt(se_now^2 + se_best^2)``, while the trained reward's mean has risen
  since that evaluation. The two evaluations share their prompts and noise, so the paired
  error would be smaller: this one is conservative (later alarms, fewer false ones). Each
  gold reward's change since the first evaluation is logged too (``/change``, ``/change_se``).
* **a monitor moves past a bound** (``limits: {name: bound}``): ``now - start > bound`` (or
  ``< bound`` for a negative one) for ``eval/monitor/<name>/mean`` or, for the
  evaluation-wide monitors, ``eval/monitor/<name>`` (colour drift starts at 0).

``keep_best`` (default: the first gold reward's mean) picks the evaluation whose checkpoint
is kept in ``<run>/checkpoints/best``: the highest value among evaluations with no alarm.
The guard's state is rebuilt from ``metrics.jsonl`` on resume (:meth:`Guard.replay`), and
the first evaluation's colour histogram is kept in ``<run>/guard_reference.pt``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrl.training.checkpoint import keep_as_best
from diffrl.training.console import say

REFERENCE_FILE = "guard_reference.pt"
BEST_DIR = "best"


@dataclass
class Verdict:
    """What one evaluation decided: its alarms, whether its checkpoint is the new best,
    and whether the run stops."""

    alarms: list[str] = field(default_factory=list)
    best: bool = False
    stop: bool = False


class Guard:
    def __init__(self, cfg):
        self.rules = cfg.guard
        self.trained = f"eval/{cfg.rewards[0].key}/mean"
        self.gold = [f"eval/gold/{spec.key}/mean" for spec in cfg.eval.gold]
        self.keep_key = cfg.guard.keep_best or (self.gold[0] if self.gold else None)
        self.start: dict | None = None
        self.best: tuple[int, float] | None = None  # (step, value of keep_key)
        self.alarms: list[tuple[int, str]] = []
        self.peaks: dict[str, tuple[float, float, float]] = {}  # gold key -> (best, its SE, trained then)
        self.watch: dict = {}  # the evaluation's reference (colour histogram), saved for resume

    # -- state ----------------------------------------------------------------------------
    def save_reference(self, run_dir: Path) -> None:
        """Write the first evaluation's reference once: it never changes after."""
        path = Path(run_dir) / REFERENCE_FILE
        if self.watch and not path.is_file():
            torch.save(self.watch, path)

    def replay(self, rows: list[dict], run_dir: Path) -> None:
        """The state after the evaluations of ``rows`` (metrics.jsonl up to the resumed step)."""
        reference = Path(run_dir) / REFERENCE_FILE
        if reference.is_file():
            self.watch = torch.load(reference, weights_only=True)
        for row in rows:
            if self.trained in row:
                self.check(int(row["step"]), dict(row))

    # -- the rules ------------------------------------------------------------------------
    def check(self, step: int, metrics: dict) -> Verdict:
        """Apply the rules to an evaluation's ``metrics`` (adding ``guard/...`` keys to it)."""
        if self.start is None:
            self.start = dict(metrics)
        alarms = self._gold_alarms(metrics) + self._limit_alarms(metrics)
        self.alarms += [(step, alarm) for alarm in alarms]
        metrics["guard/alarms"] = len(self.alarms)
        return self._verdict(step, metrics, alarms)

    def _verdict(self, step: int, metrics: dict, alarms: list[str]) -> Verdict:
        value = metrics.get(self.keep_key) if self.keep_key else None
        best = value is not None and not alarms and (self.best is None or value > self.best[1])
        if best:
            self.best = (step, float(value))
        return Verdict(alarms, best, bool(alarms) and self.rules.stop)

    def _gold_alarms(self, metrics: dict) -> list[str]:
        """Each gold reward's change since the start (logged), and an alarm where it has
        fallen from its best evaluation by more than ``gold_drop_se`` standard errors while
        the trained reward has risen since that evaluation."""
        alarms = []
        trained_now = metrics.get(self.trained, math.nan)
        for key in self.gold:
            if key not in metrics:
                continue
            se_key = key.replace("/mean", "/se")
            now, se_now = metrics[key], metrics.get(se_key, math.nan)
            metrics[key.replace("/mean", "/change")] = now - self.start.get(key, math.nan)
            metrics[key.replace("/mean", "/change_se")] = math.hypot(se_now, self.start.get(se_key, math.nan))
            peak = self.peaks.get(key)
            if peak is None or now > peak[0]:
                self.peaks[key] = (now, se_now, trained_now)
                continue
            drop, drop_se = peak[0] - now, math.hypot(se_now, peak[1])
            k, rose = self.rules.gold_drop_se, trained_now - peak[2]
            if k is not None and rose > 0 and drop > k * drop_se:
                name = key.removeprefix("eval/gold/").removesuffix("/mean")
                fell = f"gold {name} fell {drop:.3g} from its best ({drop / drop_se:.1f} SE)"
                alarms.append(f"{fell} while the trained reward rose {rose:.3g}")
        return alarms

    def _limit_alarms(self, metrics: dict) -> list[str]:
        alarms = []
        for name, bound in self.rules.limits.items():
            key = next(
                (k for k in (f"eval/monitor/{name}/mean", f"eval/monitor/{name}") if k in metrics), None
            )
            if key is None:
                continue
            change = metrics[key] - self.start.get(key, 0.0)
            if (bound >= 0 and change > bound) or (bound < 0 and change < bound):
                alarms.append(f"monitor {name} moved {change:+.3g} since the start (bound {bound:+g})")
        return alarms

    def summary(self, run_dir: Path) -> list[str]:
        """The closing table's lines: the kept checkpoint and why, and the alarms."""
        lines = []
        if self.best is not None:
            path = Path(run_dir) / "checkpoints" / BEST_DIR
            lines.append(
                f"best:        {path} (step {self.best[0]}: {self.keep_key} {self.best[1]:.3f}, "
                "the highest of the evaluations without an alarm)"
            )
        for step, alarm in self.alarms[:5]:
            lines.append(f"alarm:       step {step}: {alarm}")
        if len(self.alarms) > 5:
            lines.append(f"alarm:       ... {len(self.alarms) - 5} more (guard/alarms in metrics.jsonl)")
        return lines


def carry_out(verdict: Verdict, step: int, accelerator, run_dir: Path, checkpoint) -> bool:
    """Say the alarms, keep this evaluation's checkpoint as the best (``checkpoint()``:
    its path, saving it if it was not), and whether the run stops (after saving)."""
    for alarm in verdict.alarms:
        say(accelerator, f"guard: step {step}: {alarm}")
    if not (verdict.best or verdict.stop):
        return False
    path = checkpoint()
    if verdict.best:
        keep_as_best(accelerator, run_dir, path)
    if verdict.stop:
        say(accelerator, f"guard: stopping at step {step} (guard.stop); its checkpoint is {path}")
    return verdict.stop
