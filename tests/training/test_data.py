import pytest
import torch

from diffrl.data.prompts import PromptFileError, load_prompts
from diffrl.training.data import plan_step


def test_txt_and_jsonl(tmp_path):
    (tmp_path / "p.txt").write_text("# comment\n a cat \n\nb dog\n")
    assert load_prompts(tmp_path / "p.txt") == ["a cat", "b dog"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n{"prompt": "y", "extra": 1}\n')
    assert load_prompts(tmp_path / "p.jsonl") == ["x", "y"]


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("missing.txt", None, "does not exist"),
        ("empty.txt", "# only a comment\n\n", "has no prompts"),
        ("bad.jsonl", '{"prompt": "ok"}\n{not json}\n', r"bad\.jsonl:2: invalid JSON"),
        (
            "noprompt.jsonl",
            '{"text": "x"}\n',
            r"noprompt\.jsonl:1: expected an object with a string 'prompt'",
        ),
    ],
)
def test_bad_prompt_files(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(PromptFileError, match=match):
        load_prompts(path)


def test_non_utf8_prompt_file(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(PromptFileError, match="not UTF-8"):
        load_prompts(path)


def test_plan_is_deterministic_grouped_and_shards():
    prompts = [f"p{i}" for i in range(10)]
    a, b = plan_step(prompts, 3, 5, 3, 4), plan_step(prompts, 3, 5, 3, 4)
    assert a.prompts == b.prompts and a.keys == b.keys
    assert a.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert len(set(a.prompts)) == 3  # without replacement
    assert plan_step(prompts, 3, 6, 3, 4).keys != a.keys
    sl, shard = a.shard(1, 2)
    assert shard.prompts == a.prompts[6:] and torch.equal(shard.group_ids, a.group_ids[6:])
    with pytest.raises(ValueError, match="divisible"):
        a.shard(0, 5)


def test_shipped_prompt_paths_work_from_any_directory(tmp_path, monkeypatch):
    from diffrl.cli import main
    from diffrl.data.prompts import PROJECT_ROOT, load_prompts

    here = load_prompts("assets/shapeworld/train.txt")
    monkeypatch.chdir(tmp_path)
    assert load_prompts("assets/shapeworld/train.txt") == here
    (tmp_path / "assets" / "shapeworld").mkdir(parents=True)
    (tmp_path / "assets" / "shapeworld" / "train.txt").write_text("two red circles\n")
    assert load_prompts("assets/shapeworld/train.txt") == ["two red circles"]  # the working directory wins
    assert main(["--config", "toy_flowgrpo", "--dry-run"]) == 0
    assert (PROJECT_ROOT / "configs" / "toy_flowgrpo.yaml").is_file()


def test_the_installed_entry_points_run_the_cli():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "diffrl.train", "--config", "tiny_toy_flowgrpo", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "run plan:" in out.stdout, out.stderr
    from diffrl.data.prompts import PROJECT_ROOT

    # the console script the package installs points at the same function
    assert 'diffrl-train = "diffrl.train:entry"' in (PROJECT_ROOT / "pyproject.toml").read_text()


# ----------------------------------------------------------------------------- editing prompts


def _edit_file(tmp_path, lines: str):
    from PIL import Image

    (tmp_path / "in").mkdir(exist_ok=True)
    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "in" / "a.png")
    (tmp_path / "e.jsonl").write_text(lines)
    return tmp_path / "e.jsonl"


def test_jsonl_image_column_gives_edit_prompts_relative_to_the_file(tmp_path, monkeypatch):
    import pickle

    from rewards.prompts import EditPrompt

    path = _edit_file(
        tmp_path, '{"prompt": "make it blue", "image": "in/a.png"}\n{"prompt": "x", "image": "in/a.png"}\n'
    )
    monkeypatch.chdir("/")  # image paths do not depend on the working directory
    prompts = load_prompts(path)
    image = (tmp_path / "in" / "a.png").resolve()  # stored resolved (tmp dirs may be symlinks)
    assert prompts == [EditPrompt("make it blue", image), EditPrompt("x", image)]
    first = prompts[0]
    assert str(first) == "make it blue" and first != "make it blue" and first.image == str(image)
    assert first != 3 and not (first == None)  # noqa: E711 (comparing with non-strings is plain False)
    # the same instruction on another image is another prompt (the conditioning cache key)
    other = EditPrompt("make it blue", tmp_path / "other.png")
    assert other != first and len({first, other}) == 2
    assert pickle.loads(pickle.dumps(first)) == first  # survives gather_object


@pytest.mark.parametrize(
    "lines,match",
    [
        (
            '{"prompt": "x", "image": "in/missing.png"}\n',
            r"e\.jsonl:1: input image 'in/missing.png' does not exist",
        ),
        ('{"prompt": "x", "image": 3}\n', r"e\.jsonl:1: 'image' must be a file path"),
        ('{"prompt": "x", "image": "in/a.png"}\n{"prompt": "y"}\n', "1 of 2 prompts have an 'image'"),
    ],
)
def test_bad_image_columns_are_named(tmp_path, lines, match):
    with pytest.raises(PromptFileError, match=match):
        load_prompts(_edit_file(tmp_path, lines))


def test_editing_families_need_images_and_the_others_refuse_them(tmp_path):
    from diffrl.data.prompts import check_image_column

    edits = load_prompts(_edit_file(tmp_path, '{"prompt": "x", "image": "in/a.png"}\n'))
    check_image_column(edits, "e.jsonl", "flux_kontext", edits_images=True)
    check_image_column(["a cat"], "p.txt", "flux", edits_images=False)
    with pytest.raises(
        PromptFileError, match="'flux_kontext' edits images, but prompt file 'p.txt' has no 'image'"
    ):
        check_image_column(["a cat"], "p.txt", "flux_kontext", edits_images=True)
    with pytest.raises(PromptFileError, match="'flux' generates from text only and would ignore them"):
        check_image_column(edits, "e.jsonl", "flux", edits_images=False)


def test_unreadable_input_image_is_one_clear_error(tmp_path):
    from rewards.prompts import ImageFileError, load_image

    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ImageFileError, match="bad.png' cannot be decoded"):
        load_image(tmp_path / "bad.png")
    image = load_image(_edit_file(tmp_path, "").parent / "in" / "a.png", size=(4, 6))
    assert image.shape == (3, 4, 6) and torch.allclose(image[0], torch.ones(4, 6))


def test_a_prompt_lines_metadata_reaches_the_reward_in_a_run(tmp_path, monkeypatch):
    """GenEval lines are scored from their include / exclude (issue 60, item 3): the fields
    travel from the prompt file through the sample plan and rollout to the reward."""
    import json

    import rewards.geneval
    from diffrl.cli import main

    line = {"tag": "counting", "include": [{"class": "circle", "count": 2}], "prompt": "Two round things!"}
    (tmp_path / "m.jsonl").write_text(json.dumps(line) + "\n")
    seen, score = [], rewards.geneval.GenEval._score
    monkeypatch.setattr(
        rewards.geneval.GenEval,
        "_score",
        lambda self, px, prompts: seen.extend(prompts) or score(self, px, prompts),
    )
    args = ["--config", "tiny_toy_flowgrpo", "--set", f"data.train_prompts={tmp_path / 'm.jsonl'}"]
    args += ["--set", "eval.every=0", "--set", "rewards=[{name: geneval, args: {detector: shapeworld}}]"]
    assert main([*args, "--set", f"output_dir={tmp_path / 'run'}", "--set", "train.max_steps=1"]) == 0
    assert seen and all(p.metadata == line for p in seen)
