"""Prompt sets (issue 51, item 1): every registered set fetched from a loopback server
in its real format (tiny files written here, never the real data), verified by its pinned
hash, found again offline, and refused with one clear line when it is not there; a
changed file, a cut-short download and a second fetch of a verified file."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import subprocess
import threading

import pytest

from diffrl.data import registry
from diffrl.data import store as F
from diffrl.data.cli import main as data_cli
from diffrl.data.prompts import PromptFileError, load_prompts

# tiny files in each set's real format (the layout of the real files, not their content)
GENEVAL_LINES = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {
        "tag": "color_attr",
        "include": [
            {"class": "cup", "count": 1, "color": "red"},
            {"class": "dog", "count": 1, "color": "blue"},
        ],
        "prompt": "a photo of a red cup and a blue dog",
    },
]
CONTENT = {
    ".jsonl": "".join(json.dumps(line) + "\n" for line in GENEVAL_LINES),
    ".txt": 'A shop sign that reads "OPEN LATE"\nA mug with the words "good morning"\n',
    ".csv": 'Prompts,Category\nA red colored car.,Colors\n"A cat, sitting on a mat.",Positional\n',
    ".json": json.dumps(["a fox in a forest, anime style", "a lighthouse at dusk"]),
}
EXPECTED = {
    ".jsonl": ["a photo of a bench", "a photo of a red cup and a blue dog"],
    ".txt": ['A shop sign that reads "OPEN LATE"', 'A mug with the words "good morning"'],
    ".csv": ["A red colored car.", "A cat, sitting on a mat."],
    ".json": ["a fox in a forest, anime style", "a lighthouse at dusk"],
}


class Server:
    """A loopback HTTP server of ``files`` (URL path -> bytes) counting its requests;
    a path in ``cut`` announces more bytes than it sends, then closes."""

    def __init__(self):
        self.files, self.cut, self.requests = {}, set(), []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                body = outer.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                announced = len(body) + (100 if self.path in outer.cut else 0)
                self.send_header("Content-Length", str(announced))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def server(monkeypatch, tmp_path):
    s = Server()
    monkeypatch.setenv("DIFFRL_GITHUB_RAW", s.url + "/gh")
    monkeypatch.setenv("HF_ENDPOINT", s.url + "/hf")
    monkeypatch.setenv("DIFFRL_DATA", str(tmp_path / "data"))
    yield s
    s.close()


def _url_path(server: Server, f: registry.SourceFile) -> str:
    return F.url_of(f).removeprefix(server.url)


def serve_as_registered(server: Server, monkeypatch, contents=None, pin: str = "sha256") -> None:
    """Every registered set, its files served at the URLs the registry builds (a plain
    URL moved onto the loopback server), holding tiny files of its format, pinned as the
    real entry is (``pin='real'``), or by sha256 / git blob id."""
    sets = {}
    for name, s in registry.SETS.items():
        files = []
        for f in s.files:
            data = (contents or CONTENT)[f.local[f.local.rindex(".") :]].encode()
            if f.host == "url":
                f = dataclasses.replace(f, path=f"{server.url}/url/{name}/{f.local}")
            if pin == "sha256" or (pin == "real" and f.sha256):
                f = dataclasses.replace(
                    f, sha256=hashlib.sha256(data).hexdigest(), git_blob=None, bytes=len(data)
                )
            elif pin == "git_blob" or (pin == "real" and f.git_blob):
                f = dataclasses.replace(f, sha256=None, git_blob=F.git_blob_id(data), bytes=None)
            server.files[_url_path(server, f)] = data
            files.append(f)
        sets[name] = dataclasses.replace(s, files=tuple(files))
    monkeypatch.setattr(registry, "SETS", sets)


@pytest.mark.parametrize("pin", ["real", "git_blob"])
def test_every_set_fetches_verifies_and_loads_by_name(server, monkeypatch, pin):
    serve_as_registered(server, monkeypatch, pin=pin)
    lines = []
    for name, s in registry.SETS.items():
        paths = F.fetch(name, log=lines.append)
        assert [p.name for p in paths] == [f.local for f in s.files]
        expected = [p for f in s.files for p in EXPECTED[f.local[f.local.rindex(".") :]]]
        assert load_prompts(name) == expected, name
    assert len(lines) == sum(len(s.files) for s in registry.SETS.values())
    assert any("not pinned by diffrl" in line for line in lines) == (pin == "real")


def test_the_urls_are_the_sources_at_their_pinned_versions(monkeypatch):
    monkeypatch.delenv("DIFFRL_GITHUB_RAW", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    (geneval,) = registry.get("geneval/eval").files
    assert F.url_of(geneval) == (
        "https://raw.githubusercontent.com/djghosh13/geneval/af4902f24d3ca90ebbb446dd9891a59e0f82725f/"
        "prompts/evaluation_metadata.jsonl"
    )
    anime = registry.get("hpdv2/benchmark").files[0]
    assert F.url_of(anime) == "https://huggingface.co/datasets/zhwang/HPDv2/resolve/main/benchmark/anime.json"
    assert F.url_of(registry.get("drawbench").files[0]).startswith("https://docs.google.com/spreadsheets/")


def test_a_changed_file_is_refused_and_nothing_is_kept(server, monkeypatch):
    serve_as_registered(server, monkeypatch)
    (f,) = registry.SETS["pickscore/test"].files
    server.files[_url_path(server, f)] = b"someone edited this file\n"
    with pytest.raises(F.PromptSetError, match=r"pickscore/test.*has 25 bytes where \d+ are pinned"):
        F.fetch("pickscore/test")
    registry.SETS["pickscore/test"] = dataclasses.replace(
        registry.SETS["pickscore/test"], files=(dataclasses.replace(f, bytes=None),)
    )
    with pytest.raises(F.PromptSetError, match="does not match its sha256 .*nothing was kept"):
        F.fetch("pickscore/test")
    assert not (F.data_dir() / "pickscore/test").exists() or not any(
        (F.data_dir() / "pickscore/test").iterdir()
    )
    with pytest.raises(F.PromptSetError, match="not fetched"):
        load_prompts("pickscore/test")


def test_a_download_cut_short_is_refused(server, monkeypatch):
    serve_as_registered(server, monkeypatch)
    (f,) = registry.SETS["ocr/test"].files
    server.cut.add(_url_path(server, f))
    with pytest.raises(F.PromptSetError, match=r"cut short \(\d+ of \d+ bytes\).*run the fetch again"):
        F.fetch("ocr/test")
    assert F.local_files.__name__ and not (F.data_dir() / "ocr/test" / "test.txt").exists()


def test_a_verified_file_is_not_downloaded_again_but_is_rehashed(server, monkeypatch):
    serve_as_registered(server, monkeypatch)
    F.fetch("geneval/eval", log=lambda _: None)
    assert len(server.requests) == 1
    lines = []
    F.fetch("geneval/eval", log=lines.append)
    assert len(server.requests) == 1 and "nothing downloaded" in lines[0]
    (path,) = F.local_files("geneval/eval")
    path.write_text("tampered\n")  # changed on disk: downloaded again, and verified
    F.fetch("geneval/eval", log=lines.append)
    assert len(server.requests) == 2 and "changed on disk" in lines[1]
    assert load_prompts("geneval/eval") == EXPECTED[".jsonl"]


def test_an_unpinned_set_must_match_its_first_fetch(server, monkeypatch):
    serve_as_registered(server, monkeypatch, pin="real")
    assert not registry.SETS["drawbench"].pinned
    F.fetch("drawbench", log=lambda _: None)
    (f,) = registry.SETS["drawbench"].files
    server.files[_url_path(server, f)] = b"Prompts,Category\nA sheet edited since.,Colors\n"
    (path,) = F.local_files("drawbench")
    path.write_text("lost\n")
    with pytest.raises(F.PromptSetError, match="does not match its recorded sha256"):
        F.fetch("drawbench", log=lambda _: None)


def test_the_git_blob_id_is_git_s_own():
    data = b'A sign that reads "diffrl"\n'
    git = subprocess.run(["git", "hash-object", "--stdin"], input=data, capture_output=True, check=True)
    assert F.git_blob_id(data) == git.stdout.decode().strip()


def test_a_set_not_fetched_names_the_fetch_command(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFRL_DATA", str(tmp_path))
    with pytest.raises(F.PromptSetError) as err:
        load_prompts("geneval/eval")
    assert (
        f"prompt set 'geneval/eval' is not fetched in {tmp_path}: run `diffrl-data fetch geneval/eval`"
        in str(err.value)
    )
    with pytest.raises(PromptFileError, match="did you mean 'geneval/eval'"):
        load_prompts("geneval/evaluation")  # neither a set nor a file: the nearest set names
    with pytest.raises(PromptFileError, match="or to a prompt set name"):
        load_prompts("no_such_prompts.txt")  # nothing near: the formats and the list


def test_no_host_at_all_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFRL_GITHUB_RAW", "http://127.0.0.1:9")  # nothing listens on port 9
    with pytest.raises(F.PromptSetError, match="cannot download .*check the network"):
        F.fetch("ocr/test", tmp_path)


def test_the_command_lists_fetches_and_refuses_in_one_line(server, monkeypatch, capsys):
    serve_as_registered(server, monkeypatch)
    assert data_cli(["list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in registry.SETS) and "not fetched" in listing
    assert data_cli(["fetch", "geneval/eval", "ocr/test"]) == 0
    assert data_cli(["path", "ocr/test"]) == 0
    assert capsys.readouterr().out.strip().endswith("ocr/test/test.txt")
    assert data_cli(["fetch", "geneval/training"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unknown prompt set 'geneval/training'; known:")


def test_every_entry_names_its_source_format_licence_and_hashes():
    for name, s in registry.SETS.items():
        assert s.name == name and s.source and s.format and s.licence and s.files
        assert len({f.local for f in s.files}) == len(s.files)
        for f in s.files:
            assert f.host in ("github", "hf", "url") and f.local.rsplit(".", 1)[1] in (
                "txt",
                "jsonl",
                "csv",
                "json",
            )
            if f.host == "github":
                assert len(f.revision) == 40 and f.pinned, name  # a commit, and a hash of the file there
            assert f.sha256 is None or len(f.sha256) == 64
            assert f.git_blob is None or len(f.git_blob) == 40
        if not s.pinned:
            assert "first fetch records" in s.notes, name
    wanted = {"geneval/train", "geneval/test", "geneval/eval", "ocr/train", "ocr/test", "pickscore/train"}
    wanted |= {"pickscore/test", "hpdv2/train", "drawbench", "hpdv2/benchmark"}
    assert wanted <= set(registry.SETS)
    assert registry.get("geneval/eval").prompts == 553 and registry.get("drawbench").prompts == 200


def test_a_set_copied_by_hand_is_verified_against_its_pin_not_downloaded(server, monkeypatch, capsys):
    """Issue 62, item 7: a pinned file put in the data folder by hand was 'not fetched',
    and `fetch` downloaded it again instead of checking it."""
    serve_as_registered(server, monkeypatch)
    F.fetch("geneval/eval", log=lambda _: None)
    (path,) = F.local_files("geneval/eval")
    path.with_name(path.name + ".verified").unlink()  # as if copied from another machine
    assert data_cli(["list"]) == 0 and "geneval/eval" in capsys.readouterr().out
    assert F.local_files("geneval/eval") == [path] and len(server.requests) == 1  # verified in place
    path.with_name(path.name + ".verified").unlink()
    lines = []
    F.fetch("geneval/eval", log=lines.append)
    assert len(server.requests) == 1 and "matches its pin; recorded, nothing downloaded" in lines[0]
    path.with_name(path.name + ".verified").unlink()
    path.write_text("a hand-edited copy\n")  # does not match the pin: never taken as fetched
    with pytest.raises(F.PromptSetError, match="is not fetched"):
        F.local_files("geneval/eval")


def test_fetch_all_goes_on_past_a_failure_and_names_what_failed(server, monkeypatch, capsys):
    serve_as_registered(server, monkeypatch)
    (f,) = registry.SETS["ocr/test"].files
    server.files[_url_path(server, f)] = b"changed upstream\n"  # fails its pin
    assert data_cli(["fetch", "all"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: 1 of {len(registry.SETS)} sets not fetched: ocr/test"
    fetched = [n for n in registry.SETS if n != "ocr/test"]
    assert all(F.local_files(n) for n in fetched)  # every other set came
