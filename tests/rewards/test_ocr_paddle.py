"""PaddleOCR behind the ``ocr`` reward (rewards/ocr_paddle.py, issue 51 item 5).

Neither paddlepaddle nor PaddleOCR's models install in this offline CI, so the engine is a
stand-in answering in each PaddleOCR generation's own format (2.x: ``ocr(image, cls=False)``
-> ``[[[polygon, (text, score)], ...]]`` or ``[None]``; 3.x: ``predict(image)`` -> one
result per image with ``rec_texts``, ``rec_scores`` and ``dt_polys``), and the scores are
checked against flow_grpo's own, recorded in tests/fixtures/reference/ocr_geneval.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import rewards
from rewards import ocr_paddle
from rewards.ocr_paddle import PaddleOCRMissing, boxes_of, joined_text, lines_of

CASES = json.loads((Path(__file__).parents[1] / "fixtures/reference/ocr_geneval.json").read_text())["ocr"][
    "cases"
]


class Paddle2:
    """PaddleOCR 2.9.1's interface, reading each image as ``texts[i]`` (by its first pixel)."""

    paddleocr_version = "2.9.1"

    def __init__(self, lines_per_image):
        self.lines = lines_per_image  # first pixel value -> [(polygon, text, score)]

    def ocr(self, image, cls=True):
        assert cls is False and image.dtype == np.uint8 and image.shape[-1] == 3  # flow_grpo's call
        lines = self.lines[int(image[0, 0, 0])]
        if lines == "fail":
            raise RuntimeError("paddle inference failed")
        return [[[poly, (text, score)] for poly, text, score in lines] or None]


class Paddle3(Paddle2):
    paddleocr_version = "3.7.0"

    def ocr(self, image, cls=True):
        raise AssertionError("PaddleOCR 3 is called through predict")

    def predict(self, image):
        lines = self.lines[int(image[0, 0, 0])]
        if lines == "fail":
            raise RuntimeError("paddle inference failed")
        return [
            {
                "rec_texts": [t for _, t, _ in lines],
                "rec_scores": [s for _, _, s in lines],
                "dt_polys": [p for p, _, _ in lines],
            }
        ]


POLY = [[2, 3], [20, 3], [20, 9], [2, 9]]


def _image(index: int) -> torch.Tensor:
    """An image whose first pixel, as uint8, is ``index`` (the stand-in's key)."""
    image = torch.full((3, 24, 32), 0.5)
    image[:, 0, 0] = index / 255
    return image


@pytest.mark.parametrize("engine_class", [Paddle2, Paddle3])
def test_the_engine_s_lines_give_flow_grpo_s_scores(engine_class, monkeypatch):
    """Each reference case's recognised text as PaddleOCR's one line: our reward equals
    flow_grpo's OcrScorer on it."""
    engine = engine_class(
        {i: [(POLY, case["recognised"], 0.9)] if case["recognised"] else [] for i, case in enumerate(CASES)}
    )
    monkeypatch.setattr(ocr_paddle, "build_engine", lambda lang, use_gpu: engine)
    reward = rewards.build("ocr", engine="paddleocr")
    out = reward(torch.stack([_image(i) for i in range(len(CASES))]), [c["prompt"] for c in CASES])
    assert out["ocr"].tolist() == pytest.approx([c["flow_grpo"] for c in CASES])
    assert out["ocr_failed"].sum() == 0


@pytest.mark.parametrize("engine_class", [Paddle2, Paddle3])
def test_lines_are_joined_as_flow_grpo_joins_them(engine_class):
    """Every line with confidence above 0, in order, no separator; nothing found is ''."""
    engine = engine_class({0: [(POLY, "Cafe", 0.8), (POLY, "noise", 0.0), (POLY, "OPEN", 0.7)], 1: []})
    gen = ocr_paddle.generation(engine)
    call = (lambda img: engine.ocr(img, cls=False)) if gen == 2 else engine.predict
    first = call(np.zeros((4, 4, 3), np.uint8))
    assert lines_of(first, gen) == [("Cafe", 0.8), ("noise", 0.0), ("OPEN", 0.7)]
    assert joined_text(lines_of(first, gen)) == "CafeOPEN"
    empty = np.zeros((4, 4, 3), np.uint8)
    empty[0, 0, 0] = 1
    assert joined_text(lines_of(call(empty), gen)) == ""
    assert boxes_of(first, gen) == [(2, 3, 20, 9)] * 3


def test_an_image_the_engine_fails_on_scores_zero_and_is_counted(monkeypatch):
    engine = Paddle2({0: [(POLY, "OPEN", 0.9)], 1: "fail"})
    monkeypatch.setattr(ocr_paddle, "build_engine", lambda lang, use_gpu: engine)
    out = rewards.build("ocr", engine="paddleocr")(torch.stack([_image(0), _image(1)]), ['a "OPEN" sign'] * 2)
    assert out["ocr"].tolist() == [1.0, 0.0] and out["ocr_failed"].tolist() == [0.0, 1.0]


def test_trocr_reads_each_line_the_detector_finds(monkeypatch):
    """engine trocr_lines: PaddleOCR's polygons cropped as boxes, TrOCR on each, joined."""
    engine = Paddle3(
        {
            0: [
                ([[1, 2], [10, 2], [10, 6], [1, 6]], "x", 0.9),
                ([[3, 12], [30, 12], [30, 20], [3, 20]], "y", 0.9),
            ]
        }
    )
    monkeypatch.setattr(ocr_paddle, "build_engine", lambda lang, use_gpu: engine)
    monkeypatch.setattr(rewards.ocr.OCRReward, "_load_trocr", lambda self, pretrained, processor: None)
    reward = rewards.build("ocr", engine="trocr_lines")
    sizes = []

    def transcribe(images):
        sizes.extend(image.size for image in images)
        return ["O", "PEN"][: len(images)]

    reward.transcribe = transcribe
    out = reward(_image(0)[None], ['a sign "OPEN"'])
    assert sizes == [(9, 4), (27, 8)]  # (width, height) of each line's box
    assert out["ocr"].tolist() == [1.0]


def test_without_paddleocr_the_engine_says_how_to_install_it():
    try:
        import paddleocr  # noqa: F401
    except ImportError:
        with pytest.raises(PaddleOCRMissing, match=r"pip install 'diffrl\[paddleocr\]'.*paddleocr==2.9.1"):
            rewards.build("ocr", engine="paddleocr")
    else:
        pytest.skip("paddleocr is installed here")


def test_an_unknown_engine_is_refused():
    with pytest.raises(rewards.RewardArgsError, match="engine must be one of trocr, paddleocr, trocr_lines"):
        rewards.build("ocr", engine="tesseract")
