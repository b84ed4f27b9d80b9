"""Whether a run's replays are on-policy, said where it matters: once at start where the
configuration cannot replay its rollouts exactly, and as a warning whenever the logged
``replay/logprob_gap`` passes ``train.replay_gap_warn``.

The gap is the mean |log-prob of the training forward - log-prob stored at sampling| per
element before the iteration's first optimizer step (:mod:`diffrl.training.update`). A
run whose training forward computes what its rollouts computed logs 0, or rounding
noise: at most 1.3e-7 on the FLUX and SD3 twins under bf16 / fp16 autocast with compiled
rollouts and ``perf.exact_replay`` (tests/training/test_exact_replay.py); off-policy
runs log 1e-5 to 1e-3 there (docs/TRAINING.md, "On-policy, measured"). The default
threshold, 1e-6, sits between the two, 8x above the largest exact gap measured and 40x
below the smallest off-policy one; the clip range of flow_grpo's FLUX recipe (1e-4) is
where the gap starts to decide which samples clip.
"""

from __future__ import annotations


def replay_notes(cfg) -> list[str]:
    """One line for each reason this configuration's replays cannot be exact."""
    p, perf, model = cfg.precision, cfg.perf, cfg.model
    notes = []
    if p.rollout == "fp8" and p.train != "fp8":
        notes.append(
            "precision: FP8 rollouts under a BF16 update (the naive split) are off-policy by design: the "
            "update scores the samples under another policy than sampled them (replay gap 1e-5 to 1e-3 "
            "on the twins); precision.train: fp8 makes it the unified flow"
        )
    if "fp8" in (p.rollout, p.train) and p.scaling == "tensorwise":
        notes.append(
            "precision.scaling: tensorwise takes one activation scale per batch, so a sample is quantized "
            "differently in its rollout batch and its training micro-batch (replay gap 6e-4 to 8e-4 on the "
            "SD3 twin); rowwise replays exactly"
        )
    low = cfg.train.mixed_precision != "no" or model.dtype != "float32" or "fp8" in (p.rollout, p.train)
    if perf.compile_rollout and not perf.exact_replay and low:
        notes.append(
            "perf.exact_replay: false lets inductor skip the roundings eager code makes, so the compiled "
            "rollouts and the eager training forward differ (replay gap 7e-5 to 1e-3 on the twins)"
        )
    if model.full_finetune and model.dtype != "float32" and cfg.objective.kl_coef > 0:
        notes.append(
            f"model.full_finetune with model.dtype {model.dtype}: the KL reference keeps {model.dtype} "
            "weights (a frozen copy; fp32 would double its memory) while the policy computes with fp32 "
            "master weights, so the KL is not exactly 0 before the first update (4e-5 on the FLUX twin)"
        )
    return notes


class ReplayGapWatch:
    """Warns when ``replay/logprob_gap`` passes ``threshold`` (0: never), the first time
    and then each time it grows tenfold past the last warning, so an off-policy run is
    told once and again only if it gets worse. ``expected``: the start notes, named in
    the warning as the likely cause (none: look for what else differs)."""

    def __init__(self, threshold: float, clip_range: float, expected: list[str], say):
        self.threshold, self.clip_range = threshold, clip_range
        self.expected, self.say = expected, say
        self.warned_at: float | None = None

    def check(self, step: int, metrics: dict) -> None:
        gap = metrics.get("replay/logprob_gap")
        if gap is None or self.threshold <= 0:
            return
        gap = float(gap)
        if not gap > self.threshold or (self.warned_at is not None and gap < 10 * self.warned_at):
            return
        self.warned_at = gap
        if self.expected:
            why = "expected from this configuration (said at start)"
        else:
            why = (
                "not expected from this configuration: look for a kernel that depends on the batch size "
                "or a forward that differs between rollout and update (docs/TRAINING.md, 'On-policy')"
            )
        self.say(
            f"warning: iteration {step}: replay/logprob_gap {gap:.2g} passes train.replay_gap_warn "
            f"{self.threshold:g} (clip range {self.clip_range:g}): the update is off-policy; {why}; "
            "the next warning comes at 10x this gap"
        )
