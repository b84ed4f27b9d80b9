"""The evaluation protocols papers report, one command each (``scripts/evaluate.py --protocol``).

* ``geneval``: GenEval's benchmark (Ghosh et al. 2023): its 553 prompts
  (``geneval/eval``) x 4 images, judged by GenEval's rules (the ``geneval`` reward's
  ``geneval_correct``), summarised as GenEval's ``evaluation/summary_scores.py`` prints it
  (djghosh13/geneval@af4902f2): correct images, correct prompts (any of the four), each
  task's accuracy in the file's order, and the overall score, the mean over tasks.
  flow_grpo's strict verdict is reported beside it.
* ``ocr``: flow_grpo's OCR test set (``ocr/test``, 1018 prompts), one image each, its
  accuracy 1 - d / |text| and the share spelled exactly, read by PaddleOCR as the papers
  read it (``--reward-arg ocr.engine=trocr`` where PaddleOCR cannot be installed).
* ``drawbench``: DrawBench's 200 prompts, ``hpdv2``: HPSv2's benchmark (800 prompts in
  each of four styles): one image a prompt, the mean of HPSv2.1, PickScore, ImageReward,
  CLIPScore and the LAION aesthetic score with standard errors, by category or style.
* ``shapeworld``: the config's held-out ShapeWorld prompts, 2 images each, the verifier.

Every image's noise is keyed by (protocol, prompt index, seed), and the work goes through
the one generate-and-score loop (:mod:`diffrl.inference.generate`): chunks of
``rollout.batch_size`` in that order, dealt to the processes in turn, each prompt encoded
on its own, so the table of N processes is the table of one (tested over gloo). Only the
main process writes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

REWARD_MEANS = ("hpsv21", "pickscore", "imagereward", "clipscore", "aesthetic")


@dataclass(frozen=True)
class Protocol:
    name: str
    prompts: str | None  # a prompt set name; None: the config's data.eval_prompts
    images_per_prompt: int
    rewards: tuple[str, ...]  # reward names; their args come from the command line
    reference: str
    reward_args: dict = field(default_factory=dict)
    # (protocol, samples) -> the table (:func:`summarise`); the means of its rewards by default
    table: Callable[[Protocol, list[dict]], dict] | None = None


def _reward_means(protocol: Protocol, samples: list[dict]) -> dict:
    return means_summary(samples, _reward_keys(protocol, samples))


def _ocr_means(protocol: Protocol, samples: list[dict]) -> dict:
    return means_summary(samples, ("ocr", "ocr_exact"))


def _geneval_table(protocol: Protocol, samples: list[dict]) -> dict:
    return geneval_summary(samples)


PROTOCOLS = {
    p.name: p
    for p in [
        Protocol("geneval", "geneval/eval", 4, ("geneval",), "GenEval (arXiv:2310.11513), summary_scores.py",
                 {"geneval": {"score": "geneval"}}, _geneval_table),
        Protocol("ocr", "ocr/test", 1, ("ocr",), "flow_grpo's OCR test accuracy (arXiv:2505.05470)",
                 {"ocr": {"engine": "paddleocr"}}, _ocr_means),
        Protocol("drawbench", "drawbench", 1, REWARD_MEANS, "DrawBench (Imagen, arXiv:2205.11487)"),
        Protocol("hpdv2", "hpdv2/benchmark", 1, REWARD_MEANS, "HPSv2's benchmark (arXiv:2306.09341)"),
        Protocol("shapeworld", None, 2, ("shapeworld",), "ShapeWorld held-out prompts (docs/SHAPEWORLD.md)"),
    ]
}  # fmt: skip


# -- prompts and their groups ---------------------------------------------------------------
def protocol_items(protocol: Protocol, source: str) -> list[tuple[str, str | None]]:
    """(prompt, group) in file order: GenEval's task tag, DrawBench's category, the HPDv2
    benchmark's style (its file), or None (:class:`~diffrl.data.prompts.PromptRecord`)."""
    from diffrl.data.prompts import read_prompts

    return [(r.prompt, r.group) for r in read_prompts(source)]


# -- generating and scoring ------------------------------------------------------------------
def score_protocol(session, protocol: Protocol, items, images_per_prompt: int) -> list[dict]:
    """Every prompt's images generated and scored (:func:`~diffrl.inference.generate.generate_and_score`,
    each prompt encoded on its own, so the table of N processes is the table of one); every
    process gets every sample back, in plan order, as ``{index, prompt, group, seed, scores}``."""
    from diffrl.inference.generate import GenerationSettings, generate_and_score, plan_samples

    prompts, groups = [p for p, _ in items], [g for _, g in items]
    samples = plan_samples(prompts, list(range(images_per_prompt)), protocol.name, groups)
    scored = generate_and_score(session, samples, GenerationSettings.of(session.cfg), encode_alone=True)
    return [
        {"index": x.sample.index, "prompt": x.sample.prompt, "group": x.sample.group, "seed": x.sample.seed,
         "scores": x.scores}
        for x in scored
    ]  # fmt: skip


# -- tables -----------------------------------------------------------------------------------
def _mean_se(values: list[float], prompt_index: list[int]) -> tuple[float, float]:
    from diffrl.evaluation.scoring import standard_error

    column = torch.tensor(values, dtype=torch.float64)
    return float(column.nanmean()), standard_error(column, prompt_index)


def summarise(protocol: Protocol, samples: list[dict]) -> dict:
    """The protocol's table: ``{"rows": [[label, value, se or None, n]], "headline": ...}``."""
    return (protocol.table or _reward_means)(protocol, samples)


def _reward_keys(protocol: Protocol, samples: list[dict]) -> tuple[str, ...]:
    present = samples[0]["scores"] if samples else {}
    keys = [k for k in present if k in protocol.rewards or k.endswith(("_strict", "_partial"))]
    return tuple(keys) or tuple(present)


def means_summary(samples: list[dict], keys) -> dict:
    rows = []
    groups = list(dict.fromkeys(s["group"] for s in samples if s["group"] is not None))
    for key in keys:
        for group in [None, *groups]:
            picked = [s for s in samples if group is None or s["group"] == group]
            mean, se = _mean_se(
                [s["scores"].get(key, math.nan) for s in picked], [s["index"] for s in picked]
            )
            label = key if group is None else f"{key} / {group}"
            rows.append([label, mean, se, len({s["index"] for s in picked})])
    headline = {r[0]: r[1] for r in rows if "/" not in r[0]}
    return {"rows": rows, "headline": headline}


def geneval_summary(samples: list[dict]) -> dict:
    """GenEval's summary: images and prompts correct, each task (file order), and the
    overall score, the mean of the task accuracies; flow_grpo's strict verdict beside."""
    correct = [s["scores"]["geneval_correct"] for s in samples]
    by_prompt: dict[int, list[float]] = {}
    for s, c in zip(samples, correct):
        by_prompt.setdefault(s["index"], []).append(c)
    tasks = list(dict.fromkeys(s["group"] for s in samples))
    rows = [
        ["images", len(samples), None, len(samples)],
        ["prompts", len(by_prompt), None, len(by_prompt)],
        ["correct images", sum(correct) / len(correct), None, len(correct)],
        ["correct prompts", sum(any(v) for v in by_prompt.values()) / len(by_prompt), None, len(by_prompt)],
    ]
    task_scores = []
    for task in tasks:
        picked = [s for s in samples if s["group"] == task]
        accuracy = sum(s["scores"]["geneval_correct"] for s in picked) / len(picked)
        strict = sum(s["scores"]["geneval_strict"] for s in picked) / len(picked)
        task_scores.append(accuracy)
        rows.append([f"{task}", accuracy, None, len(picked)])
        rows.append([f"{task} (flow_grpo strict)", strict, None, len(picked)])
    overall = sum(task_scores) / len(task_scores)
    rows.append(["overall (mean over tasks)", overall, None, len(samples)])
    return {"rows": rows, "headline": {"geneval overall": overall}}


def markdown(summary: dict, title: str) -> str:
    lines = [f"### {title}", "", "| measure | value | SE | n |", "|---|---|---|---|"]
    for label, value, se, n in summary["rows"]:
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"| {label} | {shown} | {'' if se is None or math.isnan(se) else f'{se:.4f}'} | {n} |")
    return "\n".join(lines)
