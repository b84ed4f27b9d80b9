"""What each process holds under FSDP (issue 37, defects 1 and 3), on 2 gloo processes
with a mid-size toy model (about 9 M parameters, 36 MB per fp32 copy) fully fine-tuned
with its frozen KL reference: tests/training/fsdp_memory_probe.py measures, this checks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_launch import FSDP_ENV, needs_fsdp2

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@needs_fsdp2
def test_fsdp_never_holds_the_whole_model_or_whole_gradients(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = {**os.environ, **FSDP_ENV, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave the resident set
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    args += ["tests/training/fsdp_memory_probe.py", str(out), str(tmp_path / "run")]
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["fsdp"] == "FSDP" for r in rows)
    for r in rows:
        # start-up: the transformer went to the devices as shards, never whole
        assert r["moved_whole"] == []
        assert r["local_trainable_bytes"] <= r["whole_trainable_bytes"] / 2 * 1.01
        # measured 0.525 of the whole: a few small root parameters are not split evenly
        assert r["local_reference_bytes"] <= 0.6 * r["whole_reference_bytes"]
        # gradients: reduce-scattered every pass, never accumulated whole
        assert r["gradient_sync_turned_off"] == 0
