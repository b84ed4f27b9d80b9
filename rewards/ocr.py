"""OCR reward: how exactly the image spells the text the prompt quotes.

Flow-GRPO's text-rendering reward (Liu et al. 2025, "Flow-GRPO: Training Flow Matching
Models via Online RL", arXiv:2505.05470, Sec. 5, "visual text rendering"): the target is
the text between the prompt's first pair of double quotes; target and recognised text are
lower-cased with spaces removed, and the reward is

    r = 1 - min(d, |target|) / |target|,   d = Levenshtein(recognised, target)

so 1 is a perfect spelling and 0 is nothing right. flow_grpo recognises with PaddleOCR,
which does not install on current stacks; here the recogniser is any transformers
``VisionEncoderDecoderModel`` OCR checkpoint (TrOCR by default, Li et al. 2021,
arXiv:2109.10282), loaded with its processor from a hub id or a ``save_pretrained``
directory. TrOCR reads one line of text from the whole image, so it suits prompts whose
text dominates the picture (signs, posters, covers), as flow_grpo's OCR prompts do.
"""

from __future__ import annotations

import torch
from PIL import Image

from rewards.clip_common import ClipReward, hf_pretrained
from rewards.errors import some_of
from rewards.images import to_uint8_hwc

# typographic quotes count as the ASCII quote, so "Open" and “Open” give the same target
_QUOTES = str.maketrans({"\u201c": '"', "\u201d": '"'})


class OCRPromptError(ValueError):
    """A prompt has no quoted text for the OCR reward to check."""


def quoted_text(prompt: str) -> str | None:
    """The text between the first two double quotes (flow_grpo: ``prompt.split('"')[1]``),
    or None when the prompt quotes nothing (no closing quote, or empty quotes)."""
    parts = str(prompt).translate(_QUOTES).split('"')
    return parts[1] if len(parts) >= 3 and parts[1].strip() else None


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


def text_accuracy(recognised: str, target: str) -> float:
    """``1 - min(d, |t|) / |t|`` on the normalised strings (0 for an empty target)."""
    recognised, target = normalise(recognised), normalise(target)
    if not target:
        return 0.0
    return 1.0 - min(levenshtein(recognised, target), len(target)) / len(target)


class OCRReward(ClipReward):
    """``reward(images, prompts) -> {"ocr": accuracy in [0, 1], "ocr_exact": 1 if spelled exactly}``.

    Args:
        pretrained: hub id or local directory of a transformers ``VisionEncoderDecoderModel``
            OCR checkpoint (TrOCR).
        processor: its processor (hub id or directory); None uses ``pretrained``.
        max_new_tokens: longest recognised text, in tokens.
        device, dtype, batch_size: where and how to run; ``batch_size`` images per forward.

    With a ``metadata`` dict, the recognised strings are stored under ``metadata["ocr"]``.
    """

    name = "ocr"
    differentiable = False  # recognition is a discrete greedy decode
    default_pretrained = "microsoft/trocr-base-printed"

    def __init__(
        self,
        pretrained: str | None = None,
        processor: str | None = None,
        max_new_tokens: int = 32,
        device=None,
        dtype="float32",
        batch_size: int = 16,
    ):
        from transformers import AutoProcessor, VisionEncoderDecoderModel

        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if int(max_new_tokens) < 1:
            raise ValueError(f"ocr: max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = int(max_new_tokens)
        pretrained = pretrained or self.default_pretrained
        self.model = hf_pretrained(
            self.name,
            VisionEncoderDecoderModel,
            pretrained,
            unused=("encoder.pooler.",),
            output_loading_info=True,
        )
        self.processor = hf_pretrained(self.name, AutoProcessor, processor or pretrained, arg="processor")
        self._freeze()

    def _modules(self):
        return [self.model]

    def check_prompts(self, prompts: list[str]) -> None:
        bad = [p for p in prompts if quoted_text(p) is None]
        if bad:
            shown = some_of(bad)
            raise OCRPromptError(
                f"ocr reward: {len(bad)} prompt(s) quote no text to render: {shown}. Put the text "
                f'the image must show between double quotes, e.g. a sign that says "OPEN".'
            )

    @torch.no_grad()
    def read(self, pixels: torch.Tensor) -> list[str]:
        """Greedy transcription of each (3, H, W) image in [0, 1], through the checkpoint's
        own processor (it resizes and normalises as the model was trained)."""
        pil = [Image.fromarray(a) for a in to_uint8_hwc(pixels)]
        values = self.processor(images=pil, return_tensors="pt").pixel_values
        ids = self.model.generate(
            values.to(device=self.device, dtype=self.dtype),
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            num_beams=1,
        )
        return self.processor.batch_decode(ids, skip_special_tokens=True)

    def _score(self, pixels, prompts):
        texts = self.read(pixels)
        self._texts.extend(texts)
        targets = [quoted_text(p) or "" for p in prompts]  # unchecked prompts score 0, never raise
        accuracy = [text_accuracy(t, target) for t, target in zip(texts, targets)]
        exact = [
            float(bool(target) and normalise(t) == normalise(target)) for t, target in zip(texts, targets)
        ]
        return {self.name: torch.tensor(accuracy), "ocr_exact": torch.tensor(exact)}

    def __call__(self, images, prompts=None, metadata=None):
        self._texts: list[str] = []  # filled chunk by chunk by _score, in batch order
        out = super().__call__(images, prompts, metadata)
        if isinstance(metadata, dict):
            metadata[self.name] = self._texts
        return out
