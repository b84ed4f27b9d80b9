"""The first-call driver (scripts/gpu_first_call.py, issue 50 item 1): a run killed
mid-way still leaves every finished row in the output folder, and carried wheels
install offline into their own folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, make_wheel


def _rows(out: Path) -> list[dict]:
    path = out / "suite.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_killed_first_call_keeps_every_finished_row(tmp_path):
    """What the GPU machine does at 600 s: kill the command. The driver (tiny twins on
    this CPU) is killed with its workers once the precision worker's rows are written;
    they, the versions and the log are in the folder, and the table is valid up to there."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        str(SCRIPTS / "gpu_first_call.py"),
        "--cpu",
        "--out",
        str(out),
        "--families",
        "flux",
    ]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not any(r["step"] == "train" for r in _rows(out)):
            assert proc.poll() is None, "the driver ended before its precision worker wrote its rows"
            assert time.monotonic() < deadline, "no precision rows within 240 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the worker it started
        proc.wait()
    rows = _rows(out)
    steps = [r["step"] for r in rows]
    assert steps[0] == "versions" and "precision" in steps and "train" in steps
    assert any("fp8:reference exploration / merged bf16" in r["measure"] for r in rows)
    table = (out / "suite.md").read_text().splitlines()
    assert table[2:4] == ["| step | measure | value | target | ok |", "|---|---|---|---|---|"]
    assert len(table) == 4 + len(rows)  # one line per row, nothing half-written
    log = (out / "suite.log").read_text()
    assert "==== gpu_first_call" in log and "--worker precision" in log
    assert not (out / "suite.json").exists()  # written only by a run that ended


def test_carried_wheels_install_offline_into_their_own_folder(tmp_path, monkeypatch):
    from tests.helpers import load_script

    driver = load_script("gpu_first_call")
    wheels, site, out = tmp_path / "wheelhouse", tmp_path / "site", tmp_path / "out"
    wheels.mkdir()
    make_wheel(wheels, "diffrl_carried_probe", "1.2.3", "ANSWER = 42\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    names = driver.install_wheels(wheels, site, out)
    assert names == ["diffrl_carried_probe-1.2.3-py3-none-any.whl"]
    assert sys.path[0] == str(site) and os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    child = subprocess.run(  # a worker sees the carried package through PYTHONPATH
        [sys.executable, "-c", "import diffrl_carried_probe as p; print(p.ANSWER, p.__file__)"],
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert child.returncode == 0 and child.stdout.startswith("42 " + str(site))
    assert "1 installed into" in (out / "suite.log").read_text()


def test_no_wheelhouse_uses_the_machine_s_packages_and_a_broken_one_stops_with_one_line(tmp_path):
    from tests.helpers import load_script

    driver = load_script("gpu_first_call")
    out = tmp_path / "out"
    assert driver.install_wheels(tmp_path / "absent", tmp_path / "site", out) == []
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "not_a_wheel-1.0-py3-none-any.whl").write_text("not a zip")
    with pytest.raises(SystemExit, match="installing the wheels in .*broken failed"):
        driver.install_wheels(broken, tmp_path / "site", out)
    assert "pip failed" in (out / "suite.log").read_text()
