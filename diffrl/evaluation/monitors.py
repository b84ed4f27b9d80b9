"""Reward-hacking monitors that need no reward model: artefacts in each image (or video)
and the drift of the whole evaluation from the run's start (docs/TRAINING.md, "Guarding
against reward hacking", has the formulas with their reasons).

Per sample (:func:`measure`, logged as ``eval/monitor/<name>/mean`` and ``/se`` like a
reward score, on the full-resolution images):

* ``grid_energy``: the share of the luminance spectrum's high-frequency power held by
  isolated peaks. With ``Y`` the Rec. 709 luminance minus its mean, ``W`` a 2-D Hann window
  (so the image's borders do not count as an edge) and ``P = |FFT2(W Y)|^2``, the high band
  ``H`` is every frequency with ``max(|fx|, |fy|) >= 1/8`` cycles per pixel and the peaks
  are the bins of ``H`` above ``PEAK_FACTOR`` times the median of ``P`` over the 5 x 5 bins
  around them: ``sum(P[peaks]) / (sum(P[H]) + 0.001 sum(P[f != 0]))``. A periodic pattern
  (PickScore's grid artefacts, flow_grpo issue 233) puts its power in isolated bins; noise
  spreads it and an edge puts it on a ridge. On flat-coloured, hard-edged renders
  (ShapeWorld) the edges hold most of the high band, so a faint lattice there moves it
  little (tested); a rasterised diagonal's staircase and ShapeWorld's striped texture are
  periodic too (0.0 to 0.09 on its renders), which is why the guard bounds its change, not
  its value.
* ``overexposed``: the share of pixels whose luminance is at least 0.98 (clipped
  highlights: VideoAlign's over-exposure, DanceGRPO issue 41); ``exposure``: the mean
  luminance; ``saturation``: the mean of ``(max - min) / max`` over RGB (HSV saturation,
  0 where ``max`` is 0).
* For video, also ``flicker``: the mean absolute change of the mean luminance between
  consecutive frames, and ``exposure_drift``: the last frame's mean luminance minus the
  first's.

Per evaluation (:func:`colour_histogram`, :func:`histogram_distance`,
:func:`spread_across_prompts`): the mean of its samples' joint RGB histograms
(``HISTOGRAM_BINS`` bins a channel), its total-variation distance from the run's first
evaluation (``eval/monitor/colour_drift``: 0 the same colours, 1 none shared), and the
diversity across prompts (``eval/monitor/spread_across_prompts``: the mean pairwise RMS
distance between the prompts' mean thumbnails), beside the diversity across the seeds of
one prompt that ``eval/diversity`` already is.
"""

from __future__ import annotations

import itertools

import torch

PEAK_FACTOR = 10.0  # a peak: 10x the median power around it (white noise: P > 6.9 x mean, e^-6.9)
NEIGHBOURHOOD = 5  # bins a side around a peak
FLOOR = 1e-3  # of the image's whole (non-DC) power, added to the high band's
HIGH_BAND = 1 / 8  # cycles per pixel (Nyquist is 1/2)
CLIPPED = 0.98
HISTOGRAM_BINS = 8
REC709 = (0.2126, 0.7152, 0.0722)


def luminance(images: torch.Tensor) -> torch.Tensor:
    """(..., H, W) Rec. 709 luminance of (..., 3, H, W) images in [0, 1]."""
    weights = torch.tensor(REC709, dtype=images.dtype, device=images.device)
    return torch.einsum("...chw,c->...hw", images, weights)


def grid_energy(images: torch.Tensor) -> torch.Tensor:
    """(B,) the share of high-frequency power in isolated spectral peaks (module docstring),
    one image at a time: the 5 x 5 neighbourhoods take 25 copies of its spectrum (100 MB at
    1024 px), which a whole chunk at once would multiply by its size."""
    return torch.stack([_grid_energy(image[None])[0] for image in images])


def _grid_energy(images: torch.Tensor) -> torch.Tensor:
    y = luminance(images.float())
    y = y - y.mean(dim=(-2, -1), keepdim=True)
    h, w = y.shape[-2:]
    # a Hann window: the FFT's wrap-around would make the image's borders an edge of its own
    window = torch.outer(torch.hann_window(h, periodic=False), torch.hann_window(w, periodic=False))
    power = torch.fft.fft2(y * window.to(y)).abs().pow(2)
    fy, fx = torch.fft.fftfreq(h).abs(), torch.fft.fftfreq(w).abs()
    high = (torch.maximum(fy[:, None], fx[None, :]) >= HIGH_BAND).to(power.device)
    # a peak stands out from its neighbourhood (the spectrum is periodic: pad around);
    # an edge's ridge or noise does not
    padded = torch.nn.functional.pad(power[:, None], (NEIGHBOURHOOD // 2,) * 4, mode="circular")
    patches = torch.nn.functional.unfold(padded, NEIGHBOURHOOD).reshape(-1, NEIGHBOURHOOD**2, h, w)
    peaks = (power > PEAK_FACTOR * patches.median(dim=1).values) & high
    total = power.sum(dim=(-2, -1)) - power[..., 0, 0]
    band = (power * high).sum(dim=(-2, -1))
    # the floor: an image with next to no high frequencies is not a grid of numerical noise
    return (power * peaks).sum(dim=(-2, -1)) / (band + FLOOR * total).clamp_min(1e-12)


def overexposed(images: torch.Tensor) -> torch.Tensor:
    return (luminance(images.float()) >= CLIPPED).float().mean(dim=(-2, -1))


def exposure(images: torch.Tensor) -> torch.Tensor:
    return luminance(images.float()).mean(dim=(-2, -1))


def saturation(images: torch.Tensor) -> torch.Tensor:
    high, low = images.float().amax(dim=-3), images.float().amin(dim=-3)
    return torch.where(high > 0, (high - low) / high.clamp_min(1e-12), torch.zeros_like(high)).mean(
        dim=(-2, -1)
    )


def colour_histogram(images: torch.Tensor) -> torch.Tensor:
    """(B, HISTOGRAM_BINS ** 3) each sample's normalised joint RGB histogram (a video's: all
    its frames')."""
    count = images.shape[0]
    pixels = images.float().movedim(-3, -1).reshape(count, -1, 3)
    index = (pixels.clamp(0, 1) * HISTOGRAM_BINS).long().clamp_max(HISTOGRAM_BINS - 1)
    flat = (index[..., 0] * HISTOGRAM_BINS + index[..., 1]) * HISTOGRAM_BINS + index[..., 2]
    counts = torch.zeros(count, HISTOGRAM_BINS**3, dtype=torch.float64)
    counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float64))
    return counts / counts.sum(-1, keepdim=True)


def measure(images: torch.Tensor) -> list[dict]:
    """Each sample's monitors (floats, summarised as scores are) and its colour histogram
    (a tensor, kept for the evaluation's colour drift): (B, 3, H, W) images or
    (B, F, 3, H, W) videos."""
    video = images.ndim == 5
    frames = images.flatten(0, 1) if video else images
    per_frame = {
        "grid_energy": grid_energy(frames),
        "overexposed": overexposed(frames),
        "exposure": exposure(frames),
        "saturation": saturation(frames),
    }
    count = images.shape[0]
    out = {name: values.reshape(count, -1).mean(-1) for name, values in per_frame.items()}
    if video:
        light = per_frame["exposure"].reshape(count, -1)
        out["flicker"] = (light[:, 1:] - light[:, :-1]).abs().mean(-1)
        out["exposure_drift"] = light[:, -1] - light[:, 0]
    histograms = colour_histogram(images)
    rows = [{name: float(values[i]) for name, values in out.items()} for i in range(count)]
    for row, histogram in zip(rows, histograms, strict=True):
        row["colour_histogram"] = histogram
    return rows


def histogram_distance(now: torch.Tensor, start: torch.Tensor) -> float:
    """Total variation distance, ``0.5 * sum |now - start|``: 0 the same colours, 1 disjoint."""
    return float(0.5 * (now - start).abs().sum())


def spread_across_prompts(thumbs: torch.Tensor, prompt_index: list[int]) -> float:
    """The mean pairwise RMS distance between the prompts' mean thumbnails (NaN with fewer
    than two prompts): how different the images of different prompts still are."""
    groups: dict[int, list[int]] = {}
    for row, p in enumerate(prompt_index):
        groups.setdefault(p, []).append(row)
    means = [thumbs[rows].float().mean(0) for rows in groups.values()]
    pairs = list(itertools.combinations(range(len(means)), 2))
    if not pairs:
        return float("nan")
    return float(torch.stack([(means[i] - means[j]).pow(2).mean().sqrt() for i, j in pairs]).mean())
