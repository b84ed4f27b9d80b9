"""A protocol's images, saved where the official scripts read them.

GenEval's layout (djghosh13/geneval@af4902f2 ``generation/diffusers_generate.py``, read by
``evaluation/evaluate_images.py``): one folder per prompt, ``<index:05>/metadata.jsonl``
holding the prompt's metadata line and ``<index:05>/samples/<n:05>.png`` its images, so
``python evaluation/evaluate_images.py DIR --outfile results.jsonl`` rescores a ``geneval``
run with GenEval's own mmdetection stack. The other protocols use the same layout (their
metadata line is the prompt, its group and, for an edit, its input image): one folder a
prompt, PNG (lossless, unlike the JPEGs DiffusionNFT's script saves). A clip is saved as
its frames, ``samples/<n:05>/<t:03>.png``.

Each process saves the images it made, so several processes need one shared directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def metadata_line(prompt: str, group: str | None) -> dict:
    """The prompt's line: a .jsonl line as its file gave it (a GenEval line, as GenEval
    writes it), else its text, group and input image, then any fields of its row."""
    own = dict(getattr(prompt, "metadata", None) or {})
    if "prompt" in own:
        return own
    line = {"prompt": str(prompt)}
    if group is not None:
        line["group"] = group
    if getattr(prompt, "image", None):
        line["image"] = str(prompt.image)
    return {**line, **own}


class ImageWriter:
    """``writer(sample, image)`` saves one generated image under ``root`` (see the module
    docstring); ``sample`` is a :class:`~diffrl.inference.generate.Sample`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __call__(self, sample, image: torch.Tensor) -> None:
        folder = self.root / f"{sample.index:05d}"
        (folder / "samples").mkdir(parents=True, exist_ok=True)
        meta = folder / "metadata.jsonl"
        if not meta.is_file():  # any process may write it first; the content is the same
            _atomic_write(meta, json.dumps(metadata_line(sample.prompt, sample.group)))
        target = folder / "samples" / f"{sample.seed:05d}"
        if image.dim() == 4:  # (F, C, H, W): a clip, frame by frame
            target.mkdir(exist_ok=True)
            for t, frame in enumerate(image):
                _png(frame, target / f"{t:03d}.png")
        else:
            _png(image, target.with_suffix(".png"))


def _png(image: torch.Tensor, path: Path) -> None:
    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    Image.fromarray(np.ascontiguousarray(array)).save(tmp, format="PNG")
    os.replace(tmp, path)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
