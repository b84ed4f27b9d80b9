"""Reward-model benchmarking: pairwise preference accuracy, speed, memory, score
distributions and cross-reward rank correlations (``scripts/bench_rewards.py``).

Pairwise accuracy follows Pick-a-Pic's evaluation (Kirstain et al. 2023, Sec. 5): a
reward predicts a tie when its two scores differ by at most a threshold; a prediction
that matches the label earns 1, one where exactly one of prediction and label is a tie
earns 0.5, and a wrong preference earns 0. "Without ties" drops tie-labelled pairs and
compares scores strictly (equal scores earn 0.5).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rewards.errors import one_line
from rewards.ranking import kendall_tau, spearman_rho

LABELS = ("a", "b", "tie")


class PreferenceFileError(ValueError):
    """A preference file or image folder is missing or malformed; names file and line."""


@dataclass
class Pair:
    prompt: str
    image_a: Path
    image_b: Path
    label: str
    where: str = ""  # "file:line" of the pair, for error messages


def load_pairs(path: str | Path) -> list[Pair]:
    """JSONL with ``prompt``, ``image_a``, ``image_b`` (paths relative to the file) and
    ``label`` in {a, b, tie}."""
    path = Path(path)
    if not path.is_file():
        raise PreferenceFileError(f"preference file '{path}' does not exist")
    pairs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise PreferenceFileError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
        missing = [k for k in ("prompt", "image_a", "image_b", "label") if k not in row]
        if missing or row.get("label") not in LABELS:
            raise PreferenceFileError(
                f"{path}:{lineno}: need prompt, image_a, image_b and label in {LABELS}; "
                f"missing {missing}, label {row.get('label')!r}"
            )
        a, b = path.parent / row["image_a"], path.parent / row["image_b"]
        for image in (a, b):
            if not image.is_file():
                raise PreferenceFileError(f"{path}:{lineno}: image '{image}' does not exist")
        pairs.append(Pair(row["prompt"], a, b, row["label"], f"{path}:{lineno}"))
    if not pairs:
        raise PreferenceFileError(f"preference file '{path}' has no pairs")
    return pairs


def pairs_from_rankings(entries, image_root: str = "") -> list[dict]:
    """Preference rows from ranked image sets (HPDv2's test.json: ``prompt``, ``image_path``
    (a list) and ``rank`` (a list, lower is better)): every pair of one prompt's images,
    labelled by rank, equal ranks a tie."""
    rows = []
    for entry in entries:
        paths, ranks = entry["image_path"], entry["rank"]
        for i in range(len(paths)):
            for j in range(i + 1, len(paths)):
                label = "tie" if ranks[i] == ranks[j] else ("a" if ranks[i] < ranks[j] else "b")
                rows.append(
                    {
                        "prompt": entry["prompt"],
                        "image_a": str(Path(image_root) / paths[i]),
                        "image_b": str(Path(image_root) / paths[j]),
                        "label": label,
                    }
                )
    return rows


def load_folder(directory: str | Path) -> tuple[list[Path], list[str]]:
    """Images of a folder with their prompts from ``prompts.jsonl`` ({"image", "prompt"})."""
    directory = Path(directory)
    index = directory / "prompts.jsonl"
    if not index.is_file():
        raise PreferenceFileError(
            f"image folder '{directory}' needs a prompts.jsonl with one "
            '{"image": "file.png", "prompt": "..."} per line'
        )
    images, prompts = [], []
    for lineno, line in enumerate(index.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PreferenceFileError(f"{index}:{lineno}: invalid JSON ({err.msg})") from None
            if not (directory / row.get("image", "")).is_file():
                raise PreferenceFileError(f"{index}:{lineno}: image '{row.get('image')}' does not exist")
            images.append(directory / row["image"])
            prompts.append(row["prompt"])
    return images, prompts


def read_images(paths: list[Path], where: list[str] | None = None) -> torch.Tensor:
    """Float [0, 1] (N, 3, H, W); every image must have the first one's size. An image
    that does not decode (truncated, not an image) is one error naming ``where[i]`` (the
    pair's file and line) when given."""
    arrays = []
    for i, p in enumerate(paths):
        try:
            with Image.open(p) as image:
                arrays.append(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            at = f"{where[i]}: " if where else ""
            raise PreferenceFileError(
                f"{at}image '{p}' cannot be read ({one_line(err)}); replace the file or remove that line"
            ) from None
    sizes = {a.shape for a in arrays}
    if len(sizes) > 1:
        raise PreferenceFileError(f"images differ in size {sorted(sizes)}; resize them to one size first")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


# -- metrics ------------------------------------------------------------------------------
def pairwise_accuracy(
    score_a: torch.Tensor, score_b: torch.Tensor, labels: list[str], tie_threshold: float = 0.0
) -> dict[str, float]:
    """Accuracy with ties (Pick-a-Pic's credit) and without (tie-labelled pairs dropped)."""
    diff = (score_a - score_b).double()
    pred = ["tie" if abs(d) <= tie_threshold else ("a" if d > 0 else "b") for d in diff.tolist()]
    credit = [1.0 if p == y else (0.5 if "tie" in (p, y) else 0.0) for p, y in zip(pred, labels)]
    strict = [
        1.0 if (d > 0) == (y == "a") and d != 0 else (0.5 if d == 0 else 0.0)
        for d, y in zip(diff.tolist(), labels)
        if y != "tie"
    ]
    return {
        "accuracy_with_ties": sum(credit) / len(credit),
        "accuracy_without_ties": sum(strict) / len(strict) if strict else float("nan"),
        "pairs": len(labels),
        "tie_pairs": sum(y == "tie" for y in labels),
    }


def best_tie_threshold(score_a, score_b, labels) -> tuple[float, float]:
    """The threshold (among the observed |differences| and 0) with the best accuracy
    with ties: Pick-a-Pic tunes it on validation data, so on the test set it is optimistic."""
    diffs = sorted({0.0, *(abs(d) for d in (score_a - score_b).double().tolist())})
    best = max(
        diffs, key=lambda t: (pairwise_accuracy(score_a, score_b, labels, t)["accuracy_with_ties"], -t)
    )
    return best, pairwise_accuracy(score_a, score_b, labels, best)["accuracy_with_ties"]


def score_stats(scores: torch.Tensor) -> dict[str, float]:
    s = scores.double()
    q = torch.quantile(s, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    return {
        "mean": float(s.mean()),
        "std": float(s.std(unbiased=False)),
        "min": float(s.min()),
        "p05": q[0],
        "median": q[1],
        "p95": q[2],
        "max": float(s.max()),
    }


def rank_correlations(scores: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Spearman and Kendall correlations of every pair of rewards over the same images."""
    names = list(scores)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            out[f"{a} vs {b}"] = {
                "spearman": spearman_rho(scores[a], scores[b]),
                "kendall": kendall_tau(scores[a], scores[b]),
            }
    return out


# -- speed --------------------------------------------------------------------------------
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def score_all(reward, name: str, images: torch.Tensor, prompts: list[str], batch_size: int) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for s in range(0, len(prompts), batch_size):
            out.append(
                reward(images[s : s + batch_size], prompts[s : s + batch_size], {})[name]
                .detach()
                .float()
                .cpu()
            )
    return torch.cat(out)


def measure_speed(reward, name: str, images, prompts, batch_sizes, repeats: int, device="cpu") -> list[dict]:
    """Per batch size: median latency per batch, images/s, and CUDA peak memory (GiB)."""
    rows = []
    cuda = torch.device(device).type == "cuda"
    for bs in batch_sizes:
        reps = -(-bs // len(prompts))
        batch = images.repeat(reps, 1, 1, 1)[:bs]
        texts = (prompts * reps)[:bs]
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for r in range(repeats + 1):  # the first call warms up
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                reward(batch, texts, {})
            _sync(device)
            if r:
                times.append(time.perf_counter() - t0)
        latency = statistics.median(times)
        rows.append(
            {
                "batch_size": bs,
                "latency_ms": latency * 1e3,
                "images_per_s": bs / latency,
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            }
        )
    return rows
