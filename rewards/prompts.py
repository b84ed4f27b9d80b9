"""Prompts that carry more than their text: an editing instruction with the image it
edits, and a prompt with the metadata of its line.

An :class:`EditPrompt` *is* its instruction (a ``str``), so everything that handles
prompts (sample plans, prompt caches, logs, rewards that only read text) keeps working,
and it carries the path of its input image for what needs it: the editing adapters
(FLUX.1 Kontext, Qwen-Image-Edit) encode the image into the conditioning, and editing
rewards compare the edit with its source. Two edit prompts are equal only when both the
instruction and the image are, so the prompt cache never gives one image's
conditioning to another image with the same instruction.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rewards.errors import UserError


class ImageFileError(UserError, ValueError):
    """An input image is missing or cannot be decoded; the message names the file."""


class EditPrompt(str):
    """An instruction (the string value) and its input image (``image``: a file path)."""

    image: str

    def __new__(cls, instruction: str, image: str | Path):
        obj = super().__new__(cls, instruction)
        obj.image = str(image)
        return obj

    def __eq__(self, other) -> bool:
        if not isinstance(other, str):
            return NotImplemented
        return str.__eq__(self, other) and getattr(other, "image", None) == self.image

    def __ne__(self, other) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash((str(self), self.image))

    def __reduce__(self):  # gather_object / pickling keeps the image
        return (EditPrompt, (str(self), self.image))

    def __repr__(self) -> str:
        return f"EditPrompt({str(self)!r}, image={self.image!r})"


class AnnotatedPrompt(str):
    """A prompt (the string value) and the fields of the prompt-file line it came from
    (``metadata``: GenEval's ``tag`` / ``include`` / ``exclude``, a CSV row's columns).
    Like :class:`EditPrompt` it is its text everywhere a string is expected, and it equals
    and hashes as that text: metadata never changes what a model is conditioned on. The
    rewards that read metadata (``geneval``, ``reward_server``) score from it, as flow_grpo's
    reward server scores from its jsonl lines, instead of re-parsing the caption."""

    metadata: dict

    def __new__(cls, text: str, metadata: dict):
        obj = super().__new__(cls, text)
        obj.metadata = dict(metadata)
        return obj

    def __reduce__(self):  # gather_object / pickling keeps the metadata
        return (AnnotatedPrompt, (str(self), self.metadata))


def prompt_metadata(prompt: str) -> dict:
    """The metadata a prompt carries (empty for a plain string)."""
    return getattr(prompt, "metadata", None) or {}


def has_image(prompt: str) -> bool:
    return isinstance(prompt, EditPrompt)


def load_image(
    path: str | Path, size: tuple[int, int] | None = None, resample: str = "lanczos"
) -> torch.Tensor:
    """(3, H, W) float in [0, 1] from an image file, resized to ``size = (height, width)``
    when given, with PIL's ``resample`` filter (diffusers' ``VaeImageProcessor`` default
    is Lanczos)."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise ImageFileError(
            f"input image '{path}' does not exist; fix the 'image' column of the prompt file"
        )
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            if size is not None and im.size != (size[1], size[0]):
                im = im.resize((size[1], size[0]), getattr(Image.Resampling, resample.upper()))
            array = np.asarray(im, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError) as err:
        raise ImageFileError(
            f"input image '{path}' cannot be decoded ({err}); replace or re-export it"
        ) from None
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()
