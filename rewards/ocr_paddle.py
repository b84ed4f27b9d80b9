"""PaddleOCR, the OCR engine flow_grpo scores with, behind the ``ocr`` reward.

flow_grpo (yifan123/flow_grpo@ac4c86e8, ``flow_grpo/ocr.py``; its README pins
paddlepaddle-gpu 2.6.2 and paddleocr 2.9.1) builds ``PaddleOCR(use_angle_cls=False,
lang="en", use_gpu=..., show_log=False)``, calls ``ocr.ocr(image, cls=False)`` on each
image (a uint8 RGB array), and joins every recognised line whose confidence is above 0,
in the detector's order, into one string (``''.join(res[1][0] if res[1][1] > 0 else ''
for res in result[0])``; no line at all gives ''). A failure of the engine on an image
scores it 0 there; here it scores 0 too and is counted (``ocr_failed``).

PaddleOCR changed its interface in 3.0: the constructor takes
``use_textline_orientation`` (and no ``use_gpu`` / ``show_log``), ``predict(image)``
returns one result per image with ``rec_texts``, ``rec_scores`` and ``dt_polys``, and its
default English models are newer than 2.9.1's. Both generations are driven here through
the narrowest seam of each (:func:`call_engine`, :func:`lines_of`, :func:`boxes_of`);
install paddleocr 2.9.1 for flow_grpo's numbers (``pip install "diffrl[paddleocr]"`` and
a paddlepaddle build for your machine). Neither paddlepaddle nor PaddleOCR's models can
be installed in diffrl's offline CI, so the tests drive that seam with stand-ins that
answer in each generation's documented format.

The same detector also feeds TrOCR (``engine: trocr_lines``): PaddleOCR finds the text
lines, TrOCR, a line recogniser, reads each one, instead of reading the whole image as
one line.
"""

from __future__ import annotations

import numpy as np

from rewards.errors import UserError


class PaddleOCRMissing(UserError, ImportError):
    """PaddleOCR (or the paddlepaddle it runs on) does not import here."""


def generation(engine) -> int:
    """2 for PaddleOCR 2.x (``ocr``), 3 for 3.x (``predict``): by the installed version
    (an engine may say its own, ``paddleocr_version``)."""
    version = getattr(engine, "paddleocr_version", None)
    if version is None:
        import paddleocr

        version = paddleocr.__version__
    return 2 if str(version).startswith("2.") else 3


def build_engine(lang: str = "en", use_gpu: bool = False):
    """flow_grpo's PaddleOCR: no angle classifier, English, quiet."""
    try:
        import paddleocr
    except ImportError as err:
        raise PaddleOCRMissing(
            "ocr: engine paddleocr needs PaddleOCR and paddlepaddle: pip install 'diffrl[paddleocr]' and "
            "a paddlepaddle build (flow_grpo: paddlepaddle-gpu==2.6.2 with paddleocr==2.9.1); "
            f"or engine: trocr ({err})"
        ) from None
    if str(paddleocr.__version__).startswith("2."):
        return paddleocr.PaddleOCR(use_angle_cls=False, lang=lang, use_gpu=use_gpu, show_log=False)
    return paddleocr.PaddleOCR(
        lang=lang, use_textline_orientation=False, use_doc_orientation_classify=False, use_doc_unwarping=False
    )


def call_engine(engine, image: np.ndarray, gen: int):
    """One image's raw result, as each generation is called."""
    return engine.ocr(image, cls=False) if gen == 2 else engine.predict(image)


def lines_of(result, gen: int) -> list[tuple[str, float]]:
    """(text, confidence) of each recognised line, in the engine's order."""
    if gen == 2:  # [[ [box, (text, score)], ... ]], or [None] when nothing is found
        page = result[0] if result else None
        return [(str(line[1][0]), float(line[1][1])) for line in page or []]
    page = result[0] if result else {}
    return list(zip(map(str, page.get("rec_texts", [])), map(float, page.get("rec_scores", []))))


def boxes_of(result, gen: int) -> list[tuple[int, int, int, int]]:
    """The axis-aligned box (x0, y0, x1, y1) around each detected line's polygon."""
    if gen == 2:
        polygons = [line[0] for line in (result[0] if result else None) or []]
    else:
        polygons = list((result[0] if result else {}).get("dt_polys", []))
    boxes = []
    for polygon in polygons:
        points = np.asarray(polygon, dtype=np.float64).reshape(-1, 2)
        x0, y0 = np.floor(points.min(0)).astype(int)
        x1, y1 = np.ceil(points.max(0)).astype(int)
        boxes.append((int(x0), int(y0), int(x1), int(y1)))
    return boxes


def joined_text(lines: list[tuple[str, float]]) -> str:
    """flow_grpo's recognised string: every line with confidence above 0, joined."""
    return "".join(text for text, score in lines if score > 0)


class PaddleReader:
    """Reads images as flow_grpo does; ``engine`` is a built PaddleOCR (None builds one)."""

    def __init__(self, engine=None, lang: str = "en", use_gpu: bool = False):
        self.engine = engine if engine is not None else build_engine(lang, use_gpu)
        self.gen = generation(self.engine)
        self.failed = 0

    def run(self, image: np.ndarray):
        """The raw result, or None (counted in ``failed``) when the engine fails on it."""
        try:
            return call_engine(self.engine, image, self.gen)
        except Exception:  # noqa: BLE001 (flow_grpo scores any engine failure 0; counted here)
            self.failed += 1
            return None

    def read(self, images: list[np.ndarray]) -> list[str | None]:
        """Each image's recognised text, None where the engine failed."""
        results = [self.run(image) for image in images]
        return [None if r is None else joined_text(lines_of(r, self.gen)) for r in results]

    def line_boxes(self, image: np.ndarray) -> list[tuple[int, int, int, int]]:
        result = self.run(image)
        return [] if result is None else boxes_of(result, self.gen)
