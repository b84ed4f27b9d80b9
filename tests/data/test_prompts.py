"""One prompt parser for training, evaluation and protocols: each format's text, group,
metadata and input image (diffrl.data.prompts)."""

from __future__ import annotations

import json

import pytest

from diffrl.data.prompts import PromptFileError, load_prompts, read_prompts
from rewards.prompts import EditPrompt


def test_each_format_gives_its_groups_and_metadata(tmp_path):
    (tmp_path / "g.jsonl").write_text(
        '{"tag": "counting", "include": [{"class": "cat", "count": 2}], "prompt": "two cats"}\n'
        "# a comment line is skipped\n"
        '{"tag": "colors", "prompt": "a red cup"}\n'
    )
    (tmp_path / "d.csv").write_text('Prompts,Category\n"a cat, sitting",Animals\n ,Empty\nred text,Text\n')
    (tmp_path / "anime.json").write_text(json.dumps(["a girl", " ", "a castle"]))
    (tmp_path / "p.txt").write_text("one\n\n# no\ntwo\n")

    g = read_prompts(tmp_path / "g.jsonl")
    assert [(r.text, r.group) for r in g] == [("two cats", "counting"), ("a red cup", "colors")]
    assert g[0].metadata["include"] == [{"class": "cat", "count": 2}] and g[0].image is None
    d = read_prompts(tmp_path / "d.csv")
    assert [(r.text, r.group) for r in d] == [("a cat, sitting", "Animals"), ("red text", "Text")]
    assert d[0].metadata == {"Prompts": "a cat, sitting", "Category": "Animals"}
    assert [(r.text, r.group) for r in read_prompts(tmp_path / "anime.json")] == [
        ("a girl", "anime"),
        ("a castle", "anime"),
    ]
    assert [(r.text, r.group) for r in read_prompts(tmp_path / "p.txt")] == [("one", None), ("two", None)]
    # the texts are what load_prompts gives, in the same order
    assert load_prompts(tmp_path / "d.csv") == ["a cat, sitting", "red text"]


def test_an_image_line_is_an_edit_prompt_with_its_group(tmp_path):
    from PIL import Image

    (tmp_path / "in").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "in" / "a.png")
    (tmp_path / "e.jsonl").write_text('{"prompt": "make it blue", "image": "in/a.png", "tag": "recolour"}\n')
    (record,) = read_prompts(tmp_path / "e.jsonl")
    assert record.image == (tmp_path / "in" / "a.png").resolve() and record.group == "recolour"
    assert isinstance(record.prompt, EditPrompt) and str(record.prompt) == "make it blue"
    assert record.prompt.image == str(record.image)


def test_a_tag_that_is_not_text_is_no_group(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"prompt": "x", "tag": 3}\n')
    assert read_prompts(tmp_path / "t.jsonl")[0].group is None


def test_an_empty_file_is_one_error_naming_it(tmp_path):
    (tmp_path / "e.txt").write_text("# nothing\n")
    with pytest.raises(PromptFileError, match="e.txt' has no prompts"):
        read_prompts(tmp_path / "e.txt")


def test_a_paraphrase_line_renders_its_text_and_is_judged_as_its_original_with_its_fields(tmp_path):
    from diffrl.data.prompts import read_paraphrases
    from rewards.prompts import AnnotatedPrompt

    geneval = {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "red"}]}
    lines = [
        {"prompt": "a crimson box", "original": "a red square", "style": "synonyms"},
        {"prompt": "one scarlet block", "original": "a photo of a red square", **geneval},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("# a comment\n" + "".join(json.dumps(x) + "\n" for x in lines))
    plain, tagged = read_paraphrases(path)
    assert (plain.judged, plain.rendered, plain.style, plain.group) == (
        "a red square",
        "a crimson box",
        "synonyms",
        None,
    )
    assert type(plain.judged) is str and type(plain.rendered) is str
    # GenEval's fields belong to the original: the reward reads them from the judged prompt
    assert isinstance(tagged.judged, AnnotatedPrompt) and tagged.judged == "a photo of a red square"
    assert tagged.judged.metadata == {"prompt": "a photo of a red square", **geneval}
    assert tagged.rendered == "one scarlet block" and not isinstance(tagged.rendered, AnnotatedPrompt)
    assert tagged.group == "colors" and tagged.style is None


def test_a_paraphrase_line_without_its_original_is_one_error_naming_file_and_line(tmp_path):
    from diffrl.data.prompts import read_paraphrases

    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "a crimson box", "original": "a red square"}\n{"prompt": "one scarlet block"}\n'
    )
    with pytest.raises(
        PromptFileError, match=r"p.jsonl': prompt 2 \('one scarlet block'\) has no string 'original'"
    ):
        read_paraphrases(path)
