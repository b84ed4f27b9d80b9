"""``diffrl-serve``'s bad input: one ``error:`` line naming the fix and exit code 2, before
any Ray process starts (rewards/serve_cli.py, diffrl/serve.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rewards.errors import UserError
from rewards.serve_cli import main, parse_args


def test_a_wrong_reward_or_its_args_fail_before_ray_starts(monkeypatch):
    try:
        import ray

        monkeypatch.setattr(
            ray, "init", lambda *a, **k: pytest.fail("Ray started before the input was checked")
        )
    except ImportError:  # without the serve extra the input is checked all the same
        pass
    with pytest.raises(UserError, match=r"unknown reward 'nosuch'.*Valid rewards: .*shapeworld"):
        main(["--reward", "nosuch"])
    with pytest.raises(UserError, match=r"the args after '=' are not JSON"):
        main(["--reward", "jpeg_compressibility={bad"])
    with pytest.raises(UserError, match=r"must be a JSON object"):
        main(["--reward", "jpeg_compressibility=[1]"])
    for wrong in (["--route-prefix", "abc"], ["--replicas", "0"], ["--max-wait-ms", "-1"]):
        with pytest.raises(SystemExit) as stop:
            parse_args(["--reward", "shapeworld", *wrong])
        assert stop.value.code == 2


def test_the_command_says_one_error_line_and_exits_2():
    out = subprocess.run(
        [sys.executable, "-m", "diffrl.serve", "--reward", "nosuch"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 2
    assert len(lines) == 1 and lines[0].startswith("error: unknown reward 'nosuch'"), lines
