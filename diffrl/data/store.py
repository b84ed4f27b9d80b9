"""Fetching a prompt set, verifying it, and finding it again offline.

A set lives in ``<data dir>/<set name>/<file>``: the data dir is ``--dir``, else
``$DIFFRL_DATA``, else ``~/.cache/diffrl/data``. A file is downloaded to a temporary name,
checked (its length against the server's and the entry's, then its hash), and only then
renamed into place, with a ``<file>.verified`` record of its sha256 beside it: a file
without that record was never verified and is not used. Fetching a verified file again
re-hashes it on disk and downloads nothing. Hosts: GitHub's raw files
(``$DIFFRL_GITHUB_RAW``, default https://raw.githubusercontent.com), the Hugging Face hub
(``$HF_ENDPOINT``, huggingface_hub's own variable, default https://huggingface.co) and
plain URLs.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

from diffrl.data.registry import PromptSet, SourceFile, get
from rewards.errors import UserError

TIMEOUT_S = 60
CHUNK = 1 << 20


class PromptSetError(UserError, ValueError):
    """A prompt set cannot be fetched or found; the message names the set and the fix."""


def data_dir(given: str | Path | None = None) -> Path:
    if given is not None:
        return Path(given).expanduser()
    env = os.environ.get("DIFFRL_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "diffrl" / "data"


def url_of(f: SourceFile) -> str:
    if f.host == "github":
        base = os.environ.get("DIFFRL_GITHUB_RAW", "https://raw.githubusercontent.com").rstrip("/")
        return f"{base}/{f.repo}/{f.revision}/{f.path}"
    if f.host == "hf":
        base = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        return f"{base}/datasets/{f.repo}/resolve/{f.revision}/{f.path}"
    if f.host == "url":
        return f.path
    raise ValueError(f"unknown host '{f.host}'")


def git_blob_id(data: bytes) -> str:
    """Git's object id of a file with these bytes (sha1 of the blob header and the bytes)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _paths(s: PromptSet, root: Path, f: SourceFile) -> tuple[Path, Path]:
    target = root / s.name / f.local
    return target, target.with_name(target.name + ".verified")


def local_files(name: str, root: str | Path | None = None) -> list[Path]:
    """The verified local files of set ``name``; one clear error naming the fetch command
    if any is missing."""
    s, root = get(name), data_dir(root)
    files = []
    for f in s.files:
        target, record = _paths(s, root, f)
        if target.is_file() and not record.is_file():
            _verify_in_place(s, f, target, record)  # copied by hand: checked against its pin
        if not (target.is_file() and record.is_file()):
            raise PromptSetError(
                f"prompt set '{name}' is not fetched in {root}: run `diffrl-data fetch {name}` "
                f"(with network; --dir DIR or DIFFRL_DATA=DIR for another folder), or give a file path"
            )
        files.append(target)
    return files


def fetch(name: str, root: str | Path | None = None, log=print) -> list[Path]:
    """Download set ``name`` into the data dir and verify every file; a file verified
    before is re-hashed, not downloaded. Returns the local paths."""
    s, root = get(name), data_dir(root)
    return [_fetch_file(s, root, f, log) for f in s.files]


def _verify_in_place(s: PromptSet, f: SourceFile, target: Path, record: Path) -> bool:
    """A file put in the data folder by hand (copied from a machine with network): if its
    set pins it and it matches, record it as verified, exactly as a fetch would have, and
    say True. An unpinned file cannot be verified (its first fetch is its pin), nor can a
    mismatching one; both stay unrecorded (issue 62, item 7)."""
    if not (f.sha256 or f.git_blob):
        return False
    data = target.read_bytes()
    try:
        digest = _check(f, data, s.name, None)
    except PromptSetError:
        return False
    record.write_text(json.dumps({"sha256": digest, "url": url_of(f), "pinned": f.pinned}) + "\n")
    return True


def _fetch_file(s: PromptSet, root: Path, f: SourceFile, log) -> Path:
    target, record = _paths(s, root, f)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_file() and not record.is_file():
        if _verify_in_place(s, f, target, record):
            log(f"{s.name}: {target} was already here and matches its pin; recorded, nothing downloaded")
            return target
        log(f"{s.name}: {target} is here but cannot be verified against a pin; downloading it")
    recorded = _recorded(record) if record.is_file() else None
    if target.is_file() and recorded is not None:
        try:
            _check(f, target.read_bytes(), s.name, recorded)
        except PromptSetError:
            log(f"{s.name}: {target} changed on disk since it was verified; downloading it again")
        else:
            log(f"{s.name}: {target} verified before; hash checked again, nothing downloaded")
            return target
    data = _download(url_of(f), s.name, f)
    digest = _check(f, data, s.name, recorded)  # an unpinned file must match its first fetch
    partial = target.with_name(target.name + ".part")
    partial.write_bytes(data)
    partial.replace(target)
    record.write_text(json.dumps({"sha256": digest, "url": url_of(f), "pinned": f.pinned}) + "\n")
    how = (
        "its pinned hash matched"
        if f.pinned
        else "not pinned by diffrl: this sha256 is recorded for later fetches"
    )
    log(f"{s.name}: {len(data)} bytes to {target} ({how}; sha256 {digest})")
    return target


def _recorded(record: Path) -> str | None:
    try:
        return json.loads(record.read_text()).get("sha256")
    except (OSError, json.JSONDecodeError):
        return None


def _download(url: str, name: str, f: SourceFile) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "diffrl-data"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            expected = response.headers.get("Content-Length")
            data = _read_all(response)
    except urllib.error.HTTPError as err:
        raise PromptSetError(f"prompt set '{name}': {url} answered HTTP {err.code} ({err.reason})") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
        reason = getattr(err, "reason", err)
        raise PromptSetError(
            f"prompt set '{name}': cannot download {url} ({reason}); check the network, or fetch on a "
            "machine that has it and copy the data folder here"
        ) from None
    if expected is not None and len(data) != int(expected):
        raise PromptSetError(
            f"prompt set '{name}': the download of {url} was cut short ({len(data)} of {expected} bytes); "
            "nothing was kept, run the fetch again"
        )
    return data


def _read_all(response) -> bytes:
    import http.client

    parts = []
    try:
        while chunk := response.read(CHUNK):
            parts.append(chunk)
    except http.client.IncompleteRead as err:  # the connection closed before Content-Length
        parts.append(err.partial)
    return b"".join(parts)


def _check(f: SourceFile, data: bytes, name: str, recorded: str | None) -> str:
    """Raise if ``data`` is not the pinned (or first recorded) content; returns its sha256."""
    digest = hashlib.sha256(data).hexdigest()
    if f.bytes is not None and len(data) != f.bytes:
        raise PromptSetError(
            f"prompt set '{name}': {f.local} has {len(data)} bytes where {f.bytes} are pinned "
            "(a truncated or changed file); nothing was kept, run the fetch again"
        )
    if f.sha256:
        wanted, got, kind = f.sha256, digest, "sha256"
    elif f.git_blob:
        wanted, got, kind = f.git_blob, git_blob_id(data), "git blob id"
    else:  # not pinned by diffrl: the first verified fetch's hash
        wanted, got, kind = recorded, digest, "recorded sha256"
    if wanted is not None and got != wanted:
        raise PromptSetError(
            f"prompt set '{name}': {f.local} does not match its {kind} ({got} instead of {wanted}): "
            "the source changed or the download is corrupt; nothing was kept"
        )
    return digest
