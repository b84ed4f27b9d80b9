"""What the first H100 run of ``scripts/gpu_suite.py`` found, pinned on a CPU."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
import torch

from diffrl.config import load_config
from diffrl.perf import suite, suite_precision
from diffrl.training.setup import KEEP_CUDNN_ATTENTION, avoid_cudnn_attention


@pytest.mark.parametrize("family", list(suite.FAMILY_CONFIGS))
def test_every_family_s_shrunk_full_size_iteration_is_a_valid_config(family, tmp_path):
    """wan_branchgrpo's tree has 8 leaves per prompt; the suite's group of 2 made its
    iteration a configuration error on the GPU."""
    name, overrides = suite.iteration_overrides(family, cpu=False, output_dir=str(tmp_path))
    cfg = load_config(name, overrides)
    assert cfg.rollout.group_size == 2
    assert cfg.model.height == 256
    assert str(cfg.output_dir) == str(tmp_path)


@pytest.fixture
def cudnn_attention_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_training_turns_cudnn_attention_off(cudnn_attention_restored, monkeypatch):
    monkeypatch.delenv(KEEP_CUDNN_ATTENTION, raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert avoid_cudnn_attention(log=lambda _: None) is True
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert avoid_cudnn_attention(log=lambda _: None) is False  # already off: nothing to do


def test_the_variable_keeps_cudnn_attention(cudnn_attention_restored, monkeypatch):
    monkeypatch.setenv(KEEP_CUDNN_ATTENTION, "1")
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert avoid_cudnn_attention(log=lambda _: None) is False
    assert torch.backends.cuda.cudnn_sdp_enabled()


# -- the suite fits 25 minutes on one H100 by construction (issue 37, item 3) ------------------
@pytest.fixture(scope="module")
def gpu_suite():
    from tests.helpers import load_script

    return load_script("gpu_suite")


def test_every_gpu_step_has_a_budget_and_they_fit_25_minutes(gpu_suite):
    assert set(gpu_suite.GPU_BUDGET_S) == set(gpu_suite.STEPS)
    worst = sum(gpu_suite.GPU_BUDGET_S.values()) + len(gpu_suite.STEPS) * gpu_suite.GRACE_S
    assert worst + 30 <= 25 * 60  # 30 s to start the suite and write its report


def _suite_args(gpu_suite, tmp_path, **kw):
    report = gpu_suite.Report(tmp_path).start("test suite")
    return argparse.Namespace(cpu=False, report=report, **kw)


def test_a_step_past_its_budget_is_stopped_reported_and_the_next_one_runs(gpu_suite, monkeypatch, tmp_path):
    def slow(a):
        time.sleep(30)

    monkeypatch.setattr(gpu_suite, "GRACE_S", 0)
    monkeypatch.setitem(gpu_suite.STEP_FUNCTIONS, "train", slow)
    monkeypatch.setitem(gpu_suite.STEP_FUNCTIONS, "estimate", lambda a: [suite.row("estimate", "ran", 1.0)])
    a = _suite_args(gpu_suite, tmp_path)
    start = time.monotonic()
    crashed = gpu_suite.run_steps(a, ["train", "estimate"], {"train": 0.3})
    rows = a.report.rows()
    assert time.monotonic() - start < 5 and crashed == []
    assert rows[0]["step"] == "train" and "0 s budget" in rows[0]["measure"] and rows[0]["ok"] is False
    assert rows[1]["measure"] == "ran"


def test_a_child_past_its_timeout_is_killed_with_its_own_children(gpu_suite, tmp_path):
    """torch.distributed.run's workers are the launcher's children: killing the launcher
    alone would leave them holding the GPU."""
    pid_file = tmp_path / "pid"
    grandchild = "import time; time.sleep(60)"
    code = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)"
    )
    report = gpu_suite.Report(tmp_path / "out").start("test")
    report.note("the driver's own line")
    with pytest.raises(gpu_suite.StepTimeout):
        gpu_suite.Child(["-c", code], report).wait(timeout=3)
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(50):  # killed: gone, or a zombie until init reaps it
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild outlived the timeout")
    log = report.log.read_text()  # the child's output is appended to the one log, kept
    assert log.index("the driver's own line") < log.index("==== ") < log.index("started")


def test_a_failed_child_reports_its_own_output(gpu_suite, tmp_path):
    report = gpu_suite.Report(tmp_path).start("test")
    gpu_suite.Child(["-c", "print('first child')"], report).wait(timeout=30)
    with pytest.raises(RuntimeError, match="exited 3") as err:
        gpu_suite.Child(["-c", "print('second child'); raise SystemExit(3)"], report).wait(timeout=30)
    assert "second child" in str(err.value) and "first child" not in str(err.value)


def test_iteration_families_share_the_step_s_budget(gpu_suite, monkeypatch, tmp_path):
    timeouts = []

    def family(a, flags, timeout, *rest):
        timeouts.append(timeout)
        time.sleep(0.6)
        a.report.add([suite.row("iteration", f"{flags[2]}: seconds per iteration", 1.0)])

    monkeypatch.setattr(gpu_suite, "run_worker", family)
    monkeypatch.setattr(gpu_suite, "MIN_STEP_S", 0.01)
    a = _suite_args(gpu_suite, tmp_path, families="flux,sd3,sana", deadline=gpu_suite.Deadline(1.0))
    rows = gpu_suite.step_iteration(a)
    assert len(timeouts) == 2 and timeouts[0] <= 1.0 and timeouts[1] <= 0.4  # what was left
    assert [r["measure"] for r in rows] == ["sana: not run"] and rows[0]["ok"] is None  # not a failure
    assert [r["measure"] for r in a.report.rows()] == [f"{f}: seconds per iteration" for f in ("flux", "sd3")]


def test_a_deadline_too_short_for_all_steps_returns_the_finished_rows(gpu_suite, monkeypatch, tmp_path):
    """Issue 50, item 1: every row is in the output folder the moment it exists; a step
    running at the deadline is stopped and says so, and a step whose turn comes after
    it is reported as not run."""

    def precision(a):
        a.report.add([suite.row("precision", "fp8 exploration / merged bf16: speed", 1.3)])
        return []

    def slow_rewards(a):
        a.report.add([suite.row("rewards", "batch 64: img/s", 900.0)])  # one size measured, then stuck
        time.sleep(30)

    monkeypatch.setattr(gpu_suite, "GRACE_S", 0)
    monkeypatch.setattr(gpu_suite, "MIN_STEP_S", 0.5)
    monkeypatch.setitem(gpu_suite.STEP_FUNCTIONS, "precision", precision)
    monkeypatch.setitem(gpu_suite.STEP_FUNCTIONS, "rewards", slow_rewards)
    monkeypatch.setattr(gpu_suite, "resolve_plan", lambda a: (list(gpu_suite.FIRST_CALL_STEPS), {}))
    monkeypatch.setattr(gpu_suite.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("diffrl.perf.hardware.device_name", lambda device: "a stand-in GPU")
    start = time.monotonic()
    code = gpu_suite.main(["--plan", "first-call", "--deadline", "2", "--out", str(tmp_path)])
    assert time.monotonic() - start < 10
    rows = [json.loads(line) for line in (tmp_path / "suite.jsonl").read_text().splitlines()]
    table = (tmp_path / "suite.md").read_text()
    measures = [(r["step"], r["measure"]) for r in rows]
    assert measures[0] == ("versions", "python") and ("versions", "torch") in measures
    assert ("precision", "fp8 exploration / merged bf16: speed") in measures
    assert ("rewards", "batch 64: img/s") in measures  # what the stopped step finished
    assert any(s == "rewards" and m.startswith("stopped at its") for s, m in measures)
    assert ("iteration", "not run") in measures
    assert all(f"| {m} |" in table for _, m in measures)
    assert json.loads((tmp_path / "suite.json").read_text())["rows"] == rows
    assert code == 0  # no check failed, nothing crashed: missed targets are reported


def test_the_gpu_precision_race_is_flux_width_on_two_double_and_four_single_blocks():
    """Compiling the whole FLUX for the race did not finish in 290 s on the first H100 run;
    a speed ratio is per block, so the race runs a few blocks at full width."""
    from diffrl.models.arch import arch_for

    cfg = load_config(*suite_precision.precision_config(cpu=False))
    assert cfg.model.pretrained == "random:flux1-dev" and cfg.model.height == cfg.model.width == 1024
    transformer = arch_for(cfg.model.pretrained).build_transformer()  # on the meta device
    width = transformer.transformer_blocks[0].attn.to_q.weight.shape
    kept = suite_precision.keep_blocks(transformer, suite_precision.PRECISION_BLOCKS)
    assert kept == {"transformer_blocks": 2, "single_transformer_blocks": 4}
    assert len(transformer.transformer_blocks) == 2 and len(transformer.single_transformer_blocks) == 4
    assert transformer.transformer_blocks[0].attn.to_q.weight.shape == width == (3072, 3072)


def test_the_precision_race_runs_on_the_cpu_twin():
    cfg = load_config(*suite_precision.precision_config(cpu=True))
    result = suite_precision.measure_precision(
        cfg, torch.device("cpu"), ["bf16", "fp8:reference"], 2, 1, False
    )
    assert [r["mode"] for r in result["rows"]] == ["bf16", "fp8:reference"]
    rows = suite_precision.precision_rows(result, cpu=True)
    (row,) = [r for r in rows if r["measure"].endswith("speed")]
    assert "fp8:reference" in row["measure"] and "eager" in row["measure"] and row["target"] == "-"
    assert "all 1 double + 1 single blocks" in row["measure"]  # the twin at full depth
    assert [r["measure"] for r in rows if "ms per call" in r["measure"]] == [
        "bf16 merged copy, eager: ms per call"
    ]


def test_the_race_runs_all_of_flux_where_its_copies_fit():
    """12B weights: the merged BF16 copy and the FP8 copy while it is built (a BF16 deep
    copy) take 4 bytes a weight, 47.6 GB, plus 8 GiB of headroom."""
    from diffrl.models.arch import arch_for

    flux = arch_for("random:flux1-dev").build_transformer()  # on the meta device
    weights = sum(p.numel() for p in flux.parameters())
    assert 11.8e9 < weights < 12.0e9
    needed = 4 * weights + 8 * 2**30
    assert suite_precision.race_fits_full_depth(flux, needed) and not suite_precision.race_fits_full_depth(
        flux, needed - 1
    )
    h200_free, a100_free = 141e9 - 24e9, 40e9  # beside the 24 GB BF16 policy
    assert suite_precision.race_fits_full_depth(flux, h200_free) and not suite_precision.race_fits_full_depth(
        flux, a100_free
    )
    assert suite_precision.block_counts(flux) == {"transformer_blocks": 19, "single_transformer_blocks": 38}


def test_the_training_step_race_includes_the_unified_fp8_step_on_the_cpu_twin():
    """With ``train``, the precision worker also races the unified FP8 training step
    against the BF16 one on the same model (the row the next GPU window fills in)."""
    cfg = load_config(*suite_precision.precision_config(cpu=True))
    emitted = []
    result = suite_precision.measure_precision(
        cfg, torch.device("cpu"), ["bf16"], 2, 2, False, lambda k, v: emitted.append(k), train=True
    )
    assert emitted == ["precision", "train", "train_fp8"]
    t = result["train_fp8"]
    assert t["backend"] == "reference" and t["quantized_layers"] > 0
    assert t["speed_vs_bf16"] == pytest.approx(t["bf16_s"] / t["fp8_s"])
    rows = suite_precision.train_precision_rows(t, cpu=True)
    assert rows[0]["measure"].startswith("unified FP8 training step / bf16 (reference, rowwise, eager")
    assert rows[0]["target"] == "-" and rows[0]["ok"] is None  # no FP8 GEMMs on a CPU: no target
    gpu = suite_precision.train_precision_rows({**t, "backend": "torchao", "speed_vs_bf16": 1.2}, cpu=False)
    assert gpu[0]["target"] == "> 1x" and gpu[0]["ok"] is True
