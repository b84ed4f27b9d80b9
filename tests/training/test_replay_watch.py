"""What a run says about its replays: a note at start for each configuration that cannot
replay exactly, and a warning when the logged gap passes train.replay_gap_warn."""

import pytest

from diffrl.config import load_config
from diffrl.training.replay_watch import ReplayGapWatch, replay_notes

FFT = ("model.full_finetune=true", "model.dtype=bfloat16", "train.mixed_precision=bf16")
COMPILED_BF16 = ("perf.compile_rollout=true", "train.mixed_precision=bf16")


def _cfg(*sets):
    return load_config("tiny_flux_flowgrpo", list(sets))


@pytest.mark.parametrize(
    "sets,says",
    [
        ((), []),
        (("precision.rollout=fp8",), ["naive split"]),
        (("precision.rollout=fp8", "precision.train=fp8"), []),
        (("precision.rollout=fp8", "precision.train=fp8", "precision.scaling=tensorwise"), ["tensorwise"]),
        ((*COMPILED_BF16, "perf.exact_replay=false"), ["exact_replay"]),
        (("perf.compile_rollout=true", "perf.exact_replay=false"), []),  # fp32: nothing to round
        (FFT, ["KL reference"]),
        ((*FFT, "objective.kl_coef=0"), []),
    ],
)
def test_start_notes_name_each_reason_replays_cannot_be_exact(sets, says):
    notes = replay_notes(_cfg(*sets))
    assert len(notes) == len(says), notes
    for note, word in zip(notes, says):
        assert word in note


def test_the_gap_warning_comes_once_and_again_only_tenfold_worse():
    said = []
    watch = ReplayGapWatch(1e-6, 1e-4, [], said.append)
    for step, gap in enumerate([0.0, 5e-7, 3e-6, 2e-5, 2.9e-5, 3e-5, 1e-3], start=1):
        watch.check(step, {"replay/logprob_gap": gap})
    assert [s.split(":")[0] for s in said] == ["warning", "warning", "warning"]
    assert "iteration 3" in said[0] and "iteration 6" in said[1] and "iteration 7" in said[2]
    assert "not expected" in said[0] and "clip range 0.0001" in said[0]


def test_an_expected_gap_is_named_as_such_and_zero_silences():
    said = []
    ReplayGapWatch(1e-6, 1e-4, ["naive split"], said.append).check(1, {"replay/logprob_gap": 1e-4})
    assert len(said) == 1 and "expected from this configuration" in said[0]
    quiet = []
    ReplayGapWatch(0.0, 1e-4, [], quiet.append).check(1, {"replay/logprob_gap": 1.0})
    ReplayGapWatch(1e-6, 1e-4, [], quiet.append).check(1, {"loss": 1.0})  # no gap logged
    assert quiet == []
