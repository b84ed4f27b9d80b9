"""OCR reward: how exactly the image spells the text the prompt quotes.

Flow-GRPO's text-rendering reward (Liu et al. 2025, "Flow-GRPO: Training Flow Matching
Models via Online RL", arXiv:2505.05470, Sec. 5, "visual text rendering"): the target is
the text between the prompt's first pair of double quotes; target and recognised text are
lower-cased with spaces removed, the distance ``d`` is 0 when the target appears anywhere
in the recognised text and their Levenshtein distance otherwise, and the reward is

    r = 1 - min(d, |target|) / |target|

so 1 is a perfect spelling and 0 is nothing right. The containment rule is the
reference's (yifan123/flow_grpo@ac4c86e8, ``flow_grpo/ocr.py: OcrScorer.__call__``; the
same in X-GenGroup/Flow-Factory@a0b2bc5a, ``src/flow_factory/rewards/ocr.py``, and
verl-project/verl-omni@a1139baf, ``verl_omni/utils/reward_score/genrm_ocr.py:
_levenshtein_score``): "Cafe OPEN 24h" spells "OPEN" exactly, since a rendered sign may
carry other words. ``contained_is_exact=False`` keeps the stricter whole-string distance,
under which that example scores 0.0. Normalisation removes spaces only, as flow_grpo and
Flow-Factory do; verl-omni removes every whitespace character, so "Hello<TAB>World"
against "Hello World" scores 0.9 here and in flow_grpo, 1.0 in verl-omni.
tests/fixtures/reference/ocr_geneval.json holds the three references' outputs.

The engine (``engine``):

* ``paddleocr``: flow_grpo's own, PaddleOCR (an optional extra; :mod:`rewards.ocr_paddle`
  says how flow_grpo calls it and joins its lines). The one to use for numbers that sit
  beside flow_grpo's.
* ``trocr`` (the default, as it needs only transformers): any transformers
  ``VisionEncoderDecoderModel`` OCR checkpoint (TrOCR, Li et al. 2021, arXiv:2109.10282),
  loaded with its processor from a hub id or a ``save_pretrained`` directory. TrOCR is a
  line recogniser and reads the whole image as one line, so it suits prompts whose text
  dominates the picture (signs, posters, covers), as flow_grpo's OCR prompts do, and
  misses the rest of a picture with several lines.
* ``trocr_lines``: PaddleOCR's detector finds the lines and TrOCR reads each, joined in
  the detector's order as flow_grpo joins PaddleOCR's.
"""

from __future__ import annotations

import torch
from PIL import Image

from rewards.clip_common import ClipReward, hf_pretrained
from rewards.errors import some_of
from rewards.images import to_uint8_hwc

ENGINES = ("trocr", "paddleocr", "trocr_lines")
# typographic quotes count as the ASCII quote, so "Open" and “Open” give the same target
_QUOTES = str.maketrans({"\u201c": '"', "\u201d": '"'})


class OCRPromptError(ValueError):
    """A prompt has no quoted text for the OCR reward to check."""


def quoted_text(prompt: str) -> str | None:
    """The text between the first two double quotes (flow_grpo: ``prompt.split('"')[1]``),
    or None when the prompt quotes nothing (no closing quote, or empty quotes)."""
    parts = str(prompt).translate(_QUOTES).split('"')
    return parts[1] if len(parts) >= 3 and parts[1].strip() else None


def check_quoted(prompts: list[str]) -> None:
    """One :class:`OCRPromptError` naming every prompt that quotes no text to render."""
    bad = [p for p in prompts if quoted_text(p) is None]
    if bad:
        raise OCRPromptError(
            f"ocr reward: {len(bad)} prompt(s) quote no text to render: {some_of(bad)}. Put the text "
            f'the image must show between double quotes, e.g. a sign that says "OPEN".'
        )


def normalise(text: str) -> str:
    """flow_grpo's comparison form: spaces removed, lower case."""
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions each cost 1), one DP row at a time."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def text_distance(recognised: str, target: str, contained_is_exact: bool = True) -> int:
    """flow_grpo's ``d`` on the normalised strings: 0 when the target is inside the
    recognised text (with ``contained_is_exact``), else their edit distance."""
    recognised, target = normalise(recognised), normalise(target)
    if contained_is_exact and target in recognised:
        return 0
    return levenshtein(recognised, target)


def text_accuracy(recognised: str, target: str, contained_is_exact: bool = True) -> float:
    """``1 - min(d, |t|) / |t|`` (0 for an empty target, which flow_grpo divides by)."""
    length = len(normalise(target))
    if not length:
        return 0.0
    return 1.0 - min(text_distance(recognised, target, contained_is_exact), length) / length


class OCRReward(ClipReward):
    """``reward(images, prompts) -> {"ocr": accuracy in [0, 1], "ocr_exact": 1 if spelled exactly}``
    (exactly: distance 0 under the chosen rule, so with ``contained_is_exact`` a target inside
    longer text counts).

    Args:
        pretrained: hub id or local directory of a transformers ``VisionEncoderDecoderModel``
            OCR checkpoint (TrOCR).
        processor: its processor (hub id or directory); None uses ``pretrained``.
        max_new_tokens: longest recognised text, in tokens.
        contained_is_exact: a target found inside the recognised text has distance 0
            (flow_grpo's rule, the default); False scores the whole recognised text.
        engine: ``trocr``, ``paddleocr`` or ``trocr_lines`` (see the module docstring).
        lang, use_gpu: PaddleOCR's language and device (flow_grpo: ``en``).
        device, dtype, batch_size: where and how to run; ``batch_size`` images per forward.

    With a ``metadata`` dict, the recognised strings are stored under ``metadata["ocr"]``.
    ``ocr_failed`` counts images the engine failed on (scored 0, as flow_grpo scores them).
    """

    name = "ocr"
    differentiable = False  # recognition is a discrete greedy decode
    default_pretrained = "microsoft/trocr-base-printed"

    def __init__(
        self,
        pretrained: str | None = None,
        processor: str | None = None,
        max_new_tokens: int = 32,
        contained_is_exact: bool = True,
        engine: str = "trocr",
        lang: str = "en",
        use_gpu: bool = False,
        device=None,
        dtype="float32",
        batch_size: int = 16,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if engine not in ENGINES:
            raise ValueError(f"ocr: engine must be one of {', '.join(ENGINES)}, got '{engine}'")
        if int(max_new_tokens) < 1:
            raise ValueError(f"ocr: max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = int(max_new_tokens)
        if not isinstance(contained_is_exact, bool):
            raise ValueError(f"ocr: contained_is_exact must be true or false, got {contained_is_exact!r}")
        self.contained_is_exact, self.engine = contained_is_exact, engine
        self.paddle = None
        if engine != "trocr":
            from rewards.ocr_paddle import PaddleReader

            self.paddle = PaddleReader(lang=lang, use_gpu=use_gpu)
        self.model = None
        if engine != "paddleocr":
            self._load_trocr(pretrained or self.default_pretrained, processor)
        self._freeze()

    def _load_trocr(self, pretrained: str, processor: str | None) -> None:
        from transformers import AutoProcessor, VisionEncoderDecoderModel

        self.model = hf_pretrained(
            self.name,
            VisionEncoderDecoderModel,
            pretrained,
            unused=("encoder.pooler.",),
            output_loading_info=True,
        )
        self.processor = hf_pretrained(self.name, AutoProcessor, processor or pretrained, arg="processor")

    def _modules(self):
        return [] if self.model is None else [self.model]

    def check_prompts(self, prompts: list[str]) -> None:
        check_quoted(prompts)

    @classmethod
    def prompt_checker(cls, **_):
        """The prompt check without a model loaded (``--dry-run``, ``--preflight``)."""
        return check_quoted

    def read(self, pixels: torch.Tensor) -> list[str | None]:
        """Each (3, H, W) image's recognised text (None where the engine failed on it)."""
        if self.engine == "trocr":
            return self.transcribe([Image.fromarray(a) for a in to_uint8_hwc(pixels)])
        arrays = list(to_uint8_hwc(pixels))
        if self.engine == "paddleocr":
            return self.paddle.read(arrays)
        return [self._read_lines(a) for a in arrays]

    def _read_lines(self, array) -> str:
        """PaddleOCR's lines of one image, each read by TrOCR, joined in its order."""
        crops = [Image.fromarray(array).crop(box) for box in self.paddle.line_boxes(array)]
        return "".join(self.transcribe(crops)) if crops else ""

    @torch.no_grad()
    def transcribe(self, images: list) -> list[str]:
        """TrOCR's greedy transcription of each PIL image, through the checkpoint's own
        processor (it resizes and normalises as the model was trained)."""
        pil = images
        values = self.processor(images=pil, return_tensors="pt").pixel_values
        ids = self.model.generate(
            values.to(device=self.device, dtype=self.dtype),
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            num_beams=1,
        )
        return self.processor.batch_decode(ids, skip_special_tokens=True)

    def _score(self, pixels, prompts):
        read = self.read(pixels)
        failed = torch.tensor([float(t is None) for t in read])
        texts = ["" if t is None else t for t in read]  # a failed image scores 0, as in flow_grpo
        self._texts.extend(texts)
        targets = [quoted_text(p) or "" for p in prompts]  # unchecked prompts score 0, never raise
        rule = self.contained_is_exact
        accuracy = [text_accuracy(t, target, rule) for t, target in zip(texts, targets)]
        exact = [
            float(bool(normalise(target)) and text_distance(t, target, rule) == 0)
            for t, target in zip(texts, targets)
        ]
        return {self.name: torch.tensor(accuracy), "ocr_exact": torch.tensor(exact), "ocr_failed": failed}

    def __call__(self, images, prompts=None, metadata=None):
        self._texts: list[str] = []  # filled chunk by chunk by _score, in batch order
        out = super().__call__(images, prompts, metadata)
        if isinstance(metadata, dict):
            metadata[self.name] = self._texts
        return out
