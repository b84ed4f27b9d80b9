"""What a new user meets on the real-run path (issue 62): each item a line or the expected
result, never a traceback or a misleading number."""

from __future__ import annotations

import pytest

from diffrl.cli import main


def _plan(capsys, *args) -> dict[str, str]:
    assert main(["--config", "toy_flowgrpo", "--dry-run", *args]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    return {r[0]: r[1] for r in rows if len(r) == 2}


def test_dry_run_plans_for_the_process_count_of_the_launch(capsys, monkeypatch):
    """Item 10: a --dry-run before an 8-process launch reads 8 processes' numbers."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one, eight = _plan(capsys), _plan(capsys, "--num-processes", "8")
    assert one["processes"] == "1" and eight["processes"] == "8"
    assert float(eight["trajectory_buffer_mib_per_process"]) == pytest.approx(
        float(one["trajectory_buffer_mib_per_process"]) / 8, rel=0.01
    )
    monkeypatch.setenv("WORLD_SIZE", "4")  # under a launcher, its world size
    assert _plan(capsys)["processes"] == "4"


def test_a_bad_process_count_is_one_line(capsys):
    assert main(["--config", "toy_flowgrpo", "--dry-run", "--num-processes", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --num-processes must be >= 1 (got 0)"]


def test_the_shipped_toy_configs_ask_for_the_held_out_prompts_there_are():
    """Item 3: the main command warned on every start (330 asked, 328 in the file)."""
    from pathlib import Path

    from diffrl.config import CONFIG_DIR, load_config
    from diffrl.data.prompts import read_prompts

    for path in sorted(Path(CONFIG_DIR).glob("toy_*.yaml")):
        cfg = load_config(str(path))
        held_out = read_prompts(cfg.data.eval_prompts)
        assert cfg.eval.num_prompts <= len(held_out), (path.name, cfg.eval.num_prompts, len(held_out))


BOM_FILES = [(".txt", "a red square\n"), (".jsonl", '{"prompt": "a red square"}\n')]


@pytest.mark.parametrize("suffix,body", BOM_FILES)
def test_a_byte_order_mark_is_dropped_in_every_format(tmp_path, suffix, body):
    """Item 11: a BOM was kept in a .txt's first prompt and refused in a .jsonl."""
    from diffrl.data.prompts import read_prompts

    path = tmp_path / f"mine{suffix}"
    path.write_bytes("\ufeff".encode() + body.encode())
    assert [r.text for r in read_prompts(str(path))] == ["a red square"]


def test_a_directory_given_as_a_prompt_file_is_called_a_directory(tmp_path):
    """Item 6: it said 'does not exist'."""
    from diffrl.data.prompts import PromptFileError, read_prompts

    with pytest.raises(PromptFileError, match="is a directory"):
        read_prompts(str(tmp_path))


def test_the_closing_lines_name_sample_sheets_only_when_some_were_written(tmp_path):
    """Item 11: 'samples: RUN/samples/step-N.png' was printed for runs that wrote none."""
    from diffrl.training.console import closing_lines

    assert "samples:" not in closing_lines(tmp_path, None)
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step-2.png").write_bytes(b"png")
    assert "samples:" in closing_lines(tmp_path, None)


def test_a_dry_run_names_every_bad_prompt_path_at_once(capsys):
    """Item 6: a misspelt set name got no suggestion, and only the training set was named."""
    sets = ["--set", "data.train_prompts=geneval/evl", "--set", "data.eval_prompts=nope.txt"]
    assert main(["--config", "toy_flowgrpo", *sets, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "data.train_prompts: 'geneval/evl'" in err and "did you mean 'geneval/eval'" in err
    assert "data.eval_prompts: prompt file 'nope.txt' does not exist" in err
