"""Iterations that train nothing: said on the console, counted, and a stop after too many.

An iteration trains nothing when it applies no optimizer step: every group had a
non-finite reward, or every step's loss was non-finite (both are skipped, never applied).
One such iteration is a warning; ``train.max_skipped_iterations`` of them in a row end
the run with :class:`TrainingStalledError` (exit code 2), because a run that goes on
would only burn compute and exit 0 having learned nothing.
"""

from __future__ import annotations

from diffrl.inference.checkpoints import latest_complete
from diffrl.training.console import say
from rewards.errors import UserError


class TrainingStalledError(UserError, RuntimeError):
    """Too many iterations in a row applied no update."""


def no_update_message(step: int, metrics: dict, losses_skipped: int) -> str:
    """One console line saying why iteration ``step`` (1-based) trained nothing."""
    rewards = int(metrics.get("reward/nonfinite_samples", 0))
    groups = int(metrics.get("advantage/dropped_groups", 0))
    reasons = []
    if rewards:
        reasons.append(f"{rewards} non-finite reward(s), {groups} group(s) dropped")
    if losses_skipped:
        reasons.append(f"{losses_skipped} optimizer step(s) skipped for a non-finite loss or gradient")
    why = "; ".join(reasons) or "no sample was left to train on"
    return f"warning: iteration {step} applied no update ({why})"


def check_stalled(in_a_row: int, limit: int, last_checkpoint: str | None) -> None:
    """Raise once ``in_a_row`` iterations without an update reach ``limit`` (0: never)."""
    if limit <= 0 or in_a_row < limit:
        return
    where = f"the last checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved"
    raise TrainingStalledError(
        f"stopped: {in_a_row} iteration(s) in a row applied no update (non-finite rewards or losses; see "
        f"reward/nonfinite_samples and skipped/nonfinite_loss in metrics.jsonl); {where}. Check the reward "
        "model on these prompts, or lower optim.lr; train.max_skipped_iterations sets the limit "
        "(0: never stop)"
    )


def watch_updates(accelerator, counters, step: int, metrics: dict, before, limit: int, run_dir) -> None:
    """Say so when iteration ``step`` applied no update; stop after ``limit`` in a row
    (:func:`check_stalled`, naming the run's newest complete checkpoint). ``before``: the
    counters' (optimizer steps, skipped losses, fp16 overflows) before the iteration. An
    iteration whose every step the fp16 gradient scaler skipped is not held against the
    run: the scaler lowers its scale at each overflow and recovers by itself."""
    c = counters
    if c.optimizer_steps > before[0]:
        c.iterations_without_update = 0
        return
    overflows = c.skipped_fp16_overflow - before[2]
    if overflows and c.skipped_nonfinite_loss == before[1] and not metrics.get("reward/nonfinite_samples"):
        say(accelerator, f"iteration {step}: the fp16 gradient scaler skipped {overflows} step(s) (overflow)")
        return
    c.iterations_without_update += 1
    say(accelerator, no_update_message(step, metrics, c.skipped_nonfinite_loss - before[1]))
    latest = latest_complete(run_dir)
    check_stalled(c.iterations_without_update, limit, str(latest[1]) if latest else None)
