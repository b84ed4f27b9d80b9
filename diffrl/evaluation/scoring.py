"""Evaluation: fixed prompts x fixed seeds, deterministic ODE sampling.

Two prompt sets are evaluated, each logged under its own prefix:

* ``eval/``: the held-out prompts (``eval.num_prompts`` of them), what a run reports;
* ``eval_train/``: a fixed, evenly spaced subset of the *training* prompts
  (``eval.train_num_prompts``, 0 to skip), which tells a policy that fails to learn its
  own prompts apart from one that fails to generalise.

Noise keys depend only on (set, prompt index, seed), so every evaluation of a run (and of
any checkpoint) sees exactly the same initial noise. For every reward score it logs the
mean, ``<prefix>/<name>/se`` and ``<prefix>/n`` (the number of samples). The standard
error is taken over prompts (the standard deviation of the per-prompt means over the
square root of the number of prompts): the seeds of one prompt are correlated, so the
binomial sqrt(p (1 - p) / n) over all samples would understate it. ``eval/diversity`` is
the mean pairwise RMS pixel distance between the samples of the same prompt (images
downsampled to at most 64 px), so that mode collapse shows up next to the reward.

A score that does not apply to a sample is NaN (the ShapeWorld verifier's per-kind
breakdown, say): its mean and standard error leave those samples out, and
``<prefix>/<name>/n`` counts the samples that were scored when that is fewer than all
(a score that applies to none is not reported).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from diffrl.evaluation import monitors
from diffrl.inference.generate import GenerationSettings, generate_and_score, plan_samples, scored_tensor

DIVERSITY_SIZE = 64


def standard_error(values: torch.Tensor, prompt_index: list[int]) -> float:
    """Standard error of the mean over prompts: std of the per-prompt means / sqrt(#prompts)
    (NaN with fewer than two prompts)."""
    index = torch.tensor(prompt_index)
    scored = ~torch.isnan(values)
    values, index = values[scored], index[scored]
    uniq, inverse = torch.unique(index, return_inverse=True)
    if len(uniq) < 2:
        return float("nan")
    sums = torch.zeros(len(uniq), dtype=torch.float64).scatter_add_(0, inverse, values.double())
    counts = torch.zeros(len(uniq), dtype=torch.float64).scatter_add_(
        0, inverse, torch.ones_like(values.double())
    )
    means = sums / counts
    return float(means.std(unbiased=True) / len(uniq) ** 0.5)


def thumbnails(images: torch.Tensor, size: int = DIVERSITY_SIZE) -> torch.Tensor:
    """(B, D) flattened images (video: all frames) area-downsampled to at most ``size`` px."""
    frames = images.flatten(0, 1) if images.ndim == 5 else images
    h, w = frames.shape[-2:]
    if max(h, w) > size:
        scale = size / max(h, w)
        frames = torch.nn.functional.interpolate(
            frames.float(), size=(max(1, round(h * scale)), max(1, round(w * scale))), mode="area"
        )
    return frames.reshape(images.shape[0], -1).float()


def diversity(thumbs: torch.Tensor, prompt_index: list[int]) -> float:
    """Mean over prompts of the mean pairwise RMS distance between that prompt's samples
    (NaN when no prompt has two samples)."""
    groups: dict[int, list[int]] = {}
    for row, p in enumerate(prompt_index):
        groups.setdefault(p, []).append(row)
    per_prompt = []
    for rows in groups.values():
        pairs = list(itertools.combinations(rows, 2))
        if pairs:
            d = [(thumbs[i] - thumbs[j]).pow(2).mean().sqrt() for i, j in pairs]
            per_prompt.append(torch.stack(d).mean())
    return float(torch.stack(per_prompt).mean()) if per_prompt else float("nan")


SHEET_SIZE = 16


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation reads from the configuration, and nothing else."""

    num_prompts: int  # eval.num_prompts: held-out prompts per evaluation
    seeds: list[int]  # eval.seeds: one sample per prompt and seed
    generation: GenerationSettings  # the ODE sampler, its steps (sampling.eval_num_steps) and guidance
    sheet_reward: str  # the first reward's name: the score written under each sheet image

    @classmethod
    def of(cls, cfg) -> EvalSettings:
        if isinstance(cfg, cls):
            return cfg
        return cls(cfg.eval.num_prompts, cfg.eval.seeds, GenerationSettings.of(cfg), cfg.rewards[0].key)


def evaluate(
    session,
    prompts: list[str],
    settings,
    sheet_path=None,
    prefix: str = "eval",
    num_prompts: int | None = None,
    media: dict | None = None,
    refine: bool = True,
    watch: dict | None = None,
) -> dict[str, float]:
    """Every reward score over ``prompts`` (the first ``num_prompts``, default
    ``eval.num_prompts``) x ``eval.seeds``, sampled by ``session``'s policy
    (:func:`~diffrl.inference.generate.generate_and_score`): ``<prefix>/<name>/mean`` and
    ``/se``, ``<prefix>/n`` and ``<prefix>/diversity``. ``settings`` is an
    :class:`EvalSettings` or a whole config. With ``sheet_path`` the main process also
    saves the first samples (the fixed eval noise, so sheets of different steps line up)
    as a PNG, and with a ``media`` dict it fills it with those samples for the trackers
    (:func:`sample_media`). A session with PromptRL's refiner renders its greedy rewrite
    of each prompt, judged against the prompt, unless ``refine`` is off. With ``watch`` (a
    dict the caller keeps between evaluations), the gold panel (``eval.gold``) also scores
    every sample and the monitors (``eval.monitors``, :mod:`~diffrl.evaluation.monitors`)
    measure it: ``<prefix>/gold/...``, ``<prefix>/monitor/...``."""
    s = EvalSettings.of(settings)
    count = s.num_prompts if num_prompts is None else num_prompts
    chosen = prompts[:count]
    samples = plan_samples(chosen, s.seeds, prefix, rendered=refined(session, chosen) if refine else None)
    pictures = sheet_path is not None or media is not None
    measuring = watch is not None and _monitors_on(session)
    scored = generate_and_score(
        session,
        samples,
        s.generation,
        reward_fn=_with_panel(session) if watch is not None else None,
        keep_image=lambda position: pictures and position < SHEET_SIZE,
        thumbnail=thumbnails,
        measure=monitors.measure if measuring else None,
        progress=f"{prefix} ({count} prompts x {len(s.seeds)} seeds)" if _progress_bar(session) else None,
    )
    if pictures and session.acc.is_main_process:
        _pictures(scored[:SHEET_SIZE], s.sheet_reward, sheet_path, media)
    names = sorted(scored[0].scores)
    prompt_index = [x.sample.index for x in scored]
    out = _score_summary(prefix, names, scored_tensor(scored, names), prompt_index)
    thumbs = torch.stack([x.thumbnail for x in scored])
    out[f"{prefix}/diversity"] = diversity(thumbs, prompt_index)
    if measuring:
        out.update(_drift(prefix, scored, thumbs, prompt_index, watch))
    return out


def _monitors_on(session) -> bool:
    evaluation = getattr(getattr(session, "cfg", None), "eval", None)
    return bool(getattr(evaluation, "monitors", False))


def _with_panel(session):
    """The session's rewards with its gold panel's scores added as ``gold/<name>`` (the
    session's rewards alone when it has no panel)."""
    trained, gold = session.reward_fn, getattr(session, "gold_fn", None)
    if gold is None:
        return trained

    def scored(images, prompts, metadata):
        total, components, logs = trained(images, prompts, metadata)
        _, _, panel = gold(images, prompts, metadata)
        return total, components, {**logs, **{f"gold/{name}": values for name, values in panel.items()}}

    return scored


def _drift(prefix: str, scored, thumbs, prompt_index, watch: dict) -> dict[str, float]:
    """The evaluation-wide monitors: colour drift from the first watched evaluation (whose
    histogram ``watch`` keeps) and the spread across prompts."""
    histogram = torch.stack([x.extras["colour_histogram"] for x in scored]).mean(0)
    start = watch.setdefault("colour_histogram", histogram)
    return {
        f"{prefix}/monitor/colour_drift": monitors.histogram_distance(histogram, start),
        f"{prefix}/monitor/spread_across_prompts": monitors.spread_across_prompts(thumbs, prompt_index),
    }


def _progress_bar(session) -> bool:
    """Whether the run shows progress bars (``logging.progress_bar``)."""
    logging = getattr(getattr(session, "cfg", None), "logging", None)
    return bool(getattr(logging, "progress_bar", False))


def evaluate_run(session, settings=None, sheet_path=None, media=None, watch=None) -> dict[str, float]:
    """A run's evaluation: the held-out prompts (``eval/``, with the sheet and the
    trackers' media, the gold panel and the monitors, see :func:`evaluate`'s ``watch``) and,
    if configured, the training subset (``eval_train/``) and the paraphrases
    (``eval_para/``, :func:`evaluate_paraphrases`)."""
    settings = EvalSettings.of(session.cfg if settings is None else settings)
    watch = {} if watch is None else watch
    out = evaluate(session, session.eval_prompts, settings, sheet_path=sheet_path, media=media, watch=watch)
    subset = session.train_eval_prompts
    if subset:
        out.update(evaluate(session, subset, settings, prefix="eval_train", num_prompts=len(subset)))
    paraphrases = getattr(session, "eval_paraphrases", None)
    if paraphrases:
        out.update(evaluate_paraphrases(session, paraphrases, settings))
    if getattr(session, "refiner", None) is not None and session.cfg.refiner.eval_without:
        # the flow model alone, on the prompts as written: what the refiner adds
        out.update(evaluate(session, session.eval_prompts, settings, prefix="eval_plain", refine=False))
        if paraphrases:
            out.update(evaluate_paraphrases(session, paraphrases, settings, "eval_para_plain", refine=False))
    return out


def refined(session, prompts: list[str]) -> list[str] | None:
    """PromptRL's greedy rewrites of ``prompts`` (as UniRL evaluates its refiner), or None
    for a session without a refiner."""
    refiner = getattr(session, "refiner", None)
    if refiner is None or not prompts:
        return None
    keys = [("eval", i) for i in range(len(prompts))]
    return refiner.rewrite(list(prompts), keys, greedy=True).rendered(list(prompts))


def evaluate_paraphrases(
    session, paraphrases, settings, prefix: str = "eval_para", refine: bool = True
) -> dict[str, float]:
    """Prompt overfitting (PromptRL's second limit of flow RL): every paraphrase
    (:class:`~diffrl.data.prompts.Paraphrase`) and its original, each seed from the *same*
    noise key, both images judged against the original. Logs, for every reward score,
    ``<prefix>/<name>/mean`` and ``/se`` over the paraphrases, ``/original`` and
    ``/original_se`` over their originals, and ``/gap`` (original minus paraphrase) with
    ``/gap_se``, its standard error over the pairs (the pairing removes the noise both
    share); ``<prefix>/n``, ``<prefix>/diversity`` and, for lines that name their
    ``style``, each top-level score's mean per style (``<prefix>/style/<style>/<name>``).
    With PromptRL's refiner (and ``refine``), both are rendered from its rewrites of
    them: the refiner's robustness to wording is what is measured."""
    s = EvalSettings.of(settings)
    judged = [p.judged for p in paraphrases]
    rendered = [p.rendered for p in paraphrases]
    if refine and getattr(session, "refiner", None) is not None:
        originals = plan_samples(judged, s.seeds, prefix, rendered=refined(session, judged))
        rephrased = plan_samples(judged, s.seeds, prefix, rendered=refined(session, rendered))
    else:
        originals = plan_samples(judged, s.seeds, prefix)
        rephrased = plan_samples(judged, s.seeds, prefix, rendered=rendered)
    scored = generate_and_score(
        session,
        originals + rephrased,
        s.generation,
        thumbnail=thumbnails,
        progress=f"{prefix} ({len(paraphrases)} pairs x {len(s.seeds)} seeds x 2)"
        if _progress_bar(session)
        else None,
    )
    first, second = scored[: len(originals)], scored[len(originals) :]
    names = sorted(scored[0].scores)
    prompt_index = [x.sample.index for x in second]
    before, after = scored_tensor(first, names), scored_tensor(second, names)
    out = _score_summary(prefix, names, after, prompt_index)
    for j, name in enumerate(names):
        if f"{prefix}/{name}/mean" not in out:
            continue
        out[f"{prefix}/{name}/original"] = float(before[:, j].nanmean())
        out[f"{prefix}/{name}/original_se"] = standard_error(before[:, j], prompt_index)
        gap = before[:, j] - after[:, j]
        out[f"{prefix}/{name}/gap"] = float(gap.nanmean())
        out[f"{prefix}/{name}/gap_se"] = standard_error(gap, prompt_index)
    out[f"{prefix}/diversity"] = diversity(torch.stack([x.thumbnail for x in second]), prompt_index)
    out.update(_per_style(prefix, names, after, [paraphrases[i].style for i in prompt_index]))
    return out


def _per_style(prefix: str, names: list[str], scores: torch.Tensor, styles: list) -> dict[str, float]:
    """Each top-level score's mean over the paraphrases of each style."""
    out = {}
    for style in sorted({x for x in styles if x}):
        rows = torch.tensor([x == style for x in styles])
        for j, name in enumerate(names):
            if "/" not in name and not torch.isnan(scores[rows, j]).all():
                out[f"{prefix}/style/{style}/{name}"] = float(scores[rows, j].nanmean())
    return out


def _pictures(first, reward: str, sheet_path, media) -> None:
    """The sheet and the trackers' media of the first samples (main process)."""
    images = torch.stack([x.image for x in first])
    logs = {name: torch.tensor([x.scores[name] for x in first]) for name in first[0].scores}
    keys = [x.sample.key for x in first]
    # a sample rendered from other text (a refiner's rewrite) shows it after its prompt
    prompts = [
        x.sample.prompt if x.sample.rendered is None else f"{x.sample.prompt} [{x.sample.rendered}]"
        for x in first
    ]
    if sheet_path is not None:
        _save_sheet(sheet_path, images, logs[reward], keys, prompts)
    if media is not None:
        media.update(sample_media(images, logs, reward, keys, prompts, sheet_path))


def sample_media(images, logs: dict, reward: str, keys, prompts, sheet=None, count: int = SHEET_SIZE) -> dict:
    """The first ``count`` samples for a tracker: uint8 HWC images (a video's first frame),
    captions with the prompt, the seed and ``reward``'s score, and every score by name."""
    from rewards.images import to_uint8_hwc

    first = images[:count].detach().float().cpu()
    if first.ndim == 5:  # (B, F, C, H, W): the first frame
        first = first[:, 0]
    names = sorted(logs)
    scores = [[float(logs[n][i]) for n in names] for i in range(len(first))]
    captions = [
        f"{prompts[i]} | {reward} {float(logs[reward][i]):.3f} | seed {keys[i][2]}" for i in range(len(first))
    ]
    return {
        "images": list(to_uint8_hwc(first)),
        "captions": captions,
        "prompts": [str(p) for p in prompts[: len(first)]],
        "seeds": [k[2] for k in keys[: len(first)]],
        "score_names": names,
        "scores": scores,
        "sheet": sheet,
    }


def _save_sheet(path, images, scores, keys, prompts) -> None:
    from diffrl.evaluation.plots import image_sheet

    first = scores[:SHEET_SIZE].tolist()
    captions = [f"s{k[2]} {v:.2f} {p}" for k, v, p in zip(keys, first, prompts)]
    image_sheet(images[:SHEET_SIZE].cpu(), captions).save(path)


def _score_summary(prefix: str, names: list[str], gathered: torch.Tensor, prompt_index) -> dict[str, float]:
    out: dict[str, float] = {f"{prefix}/n": len(gathered)}
    for j, name in enumerate(names):
        column = gathered[:, j]
        scored = int((~torch.isnan(column)).sum())
        if scored == 0:  # applies to none of these prompts: nothing to report
            continue
        out[f"{prefix}/{name}/mean"] = float(column.nanmean())
        out[f"{prefix}/{name}/se"] = standard_error(column, prompt_index)
        if scored < len(gathered):
            out[f"{prefix}/{name}/n"] = scored
    return out
