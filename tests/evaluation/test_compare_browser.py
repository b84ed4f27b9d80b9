"""The comparison page in a real headless Chromium: it loads, every embedded image
renders, sorting by a column reorders the rows, and a screenshot is not blank. Skipped
with the reason when no Chromium is installed (.ci/run installs Debian's)."""

import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.evaluation.compare import Tile, _add_deltas
from diffrl.evaluation.compare_report import write_html

CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium / chromium-browser / google-chrome on PATH "
    "(apt-get install chromium to run this test)",
)


def _chromium(*args, timeout=60):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


class _Rows(HTMLParser):
    """Per body row: each cell's data-v (None without); plus the body's attributes."""

    def __init__(self):
        super().__init__()
        self.rows, self.body, self.in_body = [], {}, False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        elif tag == "tbody":
            self.in_body = True
        elif tag == "tr" and self.in_body:
            self.rows.append([])
        elif tag == "td" and self.in_body:
            self.rows[-1].append(attrs.get("data-v"))


@pytest.fixture
def page(tmp_path):
    g = torch.Generator().manual_seed(0)
    tiles = []
    for p in range(3):
        for s in (0, 1):
            for c in ("base", "a"):
                tiles.append(
                    Tile(
                        f"prompt {p}",
                        p,
                        s,
                        c,
                        torch.rand(3, 16, 16, generator=g),
                        {"r": float(torch.rand(1, generator=g))},
                    )
                )
    _add_deltas(tiles)
    path = tmp_path / "index.html"
    write_html(tiles, ["base", "a"], ["r"], path, "test")
    return path


def test_page_renders_sorts_and_screenshots(page, tmp_path):
    # cells: prompt, seed, base image, a image, base r, a r, a r delta -> the delta is cell 6
    dom = _chromium("--dump-dom", f"{page.as_uri()}#sort=6")
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _Rows()
    parsed.feed(dom.stdout)
    assert parsed.body.get("data-images") == "12" and parsed.body.get("data-images-ok") == "12"
    deltas = [float(r[6]) for r in parsed.rows]
    assert len(deltas) == 6 and deltas == sorted(deltas, reverse=True)
    unsorted = _Rows()
    unsorted.feed(_chromium("--dump-dom", page.as_uri()).stdout)
    assert [float(r[6]) for r in unsorted.rows] != deltas  # the click handler changed the order

    shot = tmp_path / "shot.png"
    out = _chromium(f"--screenshot={shot}", "--window-size=900,700", f"{page.as_uri()}#sort=6")
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    # the random-noise tiles put many distinct colours on the page; a blank or failed page has few
    assert len(np.unique(pixels, axis=0)) > 1000
