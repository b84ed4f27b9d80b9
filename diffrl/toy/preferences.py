"""A small offline preference set from ShapeWorld, for ``scripts/bench_rewards.py``.

Each pair shows one held-out prompt twice: a render that satisfies it and a render of
:func:`~rewards.shapeworld.render.corrupt` (one clause broken: a wrong count, colour or
shape, a missing object, or the opposite relation), in random order; the label names
the correct one. Some pairs are two different correct renders, labelled ``tie``. The
ground truth is exact, so the ShapeWorld verifier should score 100 % without ties while
general-purpose rewards show what they do on images they were never trained on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image

from rewards.shapeworld.grammar import parse, split
from rewards.shapeworld.render import corrupt, render


def write_pairs(directory, pairs: int = 48, ties: int = 8, seed: int = 0, resolution: int = 32) -> Path:
    """Write ``pairs.jsonl`` and the PNGs under ``directory``; returns the JSONL path."""
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    _, heldout = split(seed)
    rows = []
    for i in range(pairs + ties):
        prompt = rnd.choice(heldout)
        spec = parse(prompt)
        good = render(spec, rnd, resolution)
        tie = i >= pairs
        other = render(spec if tie else corrupt(spec, rnd), rnd, resolution)
        swap = rnd.random() < 0.5
        a, b = (other, good) if swap else (good, other)
        names = [f"images/{i:03d}_a.png", f"images/{i:03d}_b.png"]
        for name, array in zip(names, (a, b)):
            Image.fromarray(array).save(directory / name)
        label = "tie" if tie else ("b" if swap else "a")
        rows.append({"prompt": prompt, "image_a": names[0], "image_b": names[1], "label": label})
    out = directory / "pairs.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
