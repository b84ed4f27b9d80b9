"""The evaluation protocols papers report, one command each (``scripts/evaluate.py --protocol``).

* ``geneval``: GenEval's benchmark (Ghosh et al. 2023): its 553 prompts
  (``geneval/eval``) x 4 images, judged by GenEval's rules (the ``geneval`` reward's
  ``geneval_correct``), summarised as GenEval's ``evaluation/summary_scores.py`` prints it
  (djghosh13/geneval@af4902f2): correct images, correct prompts (any of the four), each
  task's accuracy in the file's order, and the overall score, the mean over tasks.
  flow_grpo's strict verdict is reported beside it.
* ``geneval_test``: what DiffusionNFT's GenEval column scores (NVlabs/DiffusionNFT@24af555
  ``scripts/evaluation.py --dataset geneval``): flow_grpo's test split (``geneval/test``,
  2,212 lines: GenEval's 553 prompts four times each, shuffled), one image a line, its
  detector fed as that script's in-process ``gen_eval`` feeds it (RGB arrays that
  mmdetection reads as BGR), the ``accuracy`` it prints (GenEval's verdict, the mean over
  images) and each task's.
* ``ocr``: flow_grpo's OCR test set (``ocr/test``, 1018 prompts), one image each, its
  accuracy 1 - d / |text| and the share spelled exactly, read by PaddleOCR as the papers
  read it (``--reward-arg ocr.engine=trocr`` where PaddleOCR cannot be installed).
* ``drawbench``: DiffusionNFT's DrawBench table (``--dataset drawbench``): DrawBench's 200
  prompts x 5 images, its six columns at its scales: ImageReward, PickScore / 26, the LAION
  aesthetic score, UnifiedReward-7b-v1.5's "Final Score" / 5 (asked through the
  OpenAI-compatible judge backend, its question read from DiffusionNFT's code), the CLIP
  ViT-L/14 cosine and HPSv2.1, by category too.
* ``pickscore``: the same six columns on PickScore's test split (``pickscore/test``, 2,048
  prompts, one image each; ``--dataset pickscore``).
* ``hpdv2``: HPSv2's benchmark (800 prompts in each of four styles), one image a prompt,
  the means of HPSv2.1, PickScore, ImageReward, CLIPScore and the LAION aesthetic score.
* ``shapeworld``: the config's held-out ShapeWorld prompts, 2 images each, the verifier.

Every image's noise is keyed by (protocol, prompt index, seed), and the work goes through
the one generate-and-score loop (:mod:`diffrl.inference.generate`): chunks of
``rollout.batch_size`` in that order, dealt to the processes in turn, each prompt encoded
on its own, so the table of N processes is the table of one (tested over gloo). Only the
main process writes the table; every image is saved by the process that made it, in
GenEval's layout (:mod:`diffrl.evaluation.protocol_images`), so the official scripts can
rescore them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

REWARD_MEANS = ("hpsv21", "pickscore", "imagereward", "clipscore", "aesthetic")
# DiffusionNFT's UnifiedReward client (flow_grpo/rewards.py: unifiedreward_score_sglang):
# its server address and model name, temperature 0, "Final Score: x" with x in 1-5 (any
# other answer scores 0), divided by 5 in the table
UNIFIEDREWARD = {
    "backend": "openai",
    "base_url": "http://127.0.0.1:17140/v1",
    "model": "UnifiedReward-7b-v1.5",
    "template": "unifiedreward",
    "mode": "text",
    "pattern": r"Final Score:\s*([1-5](?:\.\d+)?)",
    "low": 1,
    "high": 5,
    "unparsed": "zero",
}


@dataclass(frozen=True)
class Column:
    """One column of a paper's table: the logged score ``key`` times ``scale``."""

    label: str
    key: str
    scale: float = 1.0


# DiffusionNFT's evaluation.py columns for --dataset drawbench and pickscore
NFT_COLUMNS = (
    Column("ImageReward", "imagereward"),
    Column("PickScore / 26", "pickscore", 1 / 26),
    Column("Aesthetic", "aesthetic"),
    Column("UnifiedReward / 5", "unifiedreward/vlm_judge_raw", 1 / 5),
    Column("CLIP cosine", "clipscore_cosine"),
    Column("HPSv2.1", "hpsv21"),
    Column("UnifiedReward answers without a score (read as 0)", "unifiedreward/vlm_judge_unparsed"),
)
NFT_REWARDS = ("imagereward", "pickscore", "aesthetic", "unifiedreward", "clipscore", "hpsv21")


@dataclass(frozen=True)
class Protocol:
    name: str
    prompts: str | None  # a prompt set name; None: the config's data.eval_prompts
    images_per_prompt: int
    rewards: tuple[
        str, ...
    ]  # reward keys (registry names unless reward_names says); args from the command line
    reference: str
    reward_args: dict = field(default_factory=dict)
    # (protocol, samples) -> the table (:func:`summarise`); the means of its rewards by default
    table: Callable[[Protocol, list[dict]], dict] | None = None
    columns: tuple[Column, ...] = ()  # a paper's columns and scales; else every reward's mean
    reward_names: dict = field(default_factory=dict)  # key -> registry name, where they differ


def _reward_means(protocol: Protocol, samples: list[dict]) -> dict:
    if protocol.columns:
        return columns_summary(samples, protocol.columns)
    return means_summary(samples, _reward_keys(protocol, samples))


def _ocr_means(protocol: Protocol, samples: list[dict]) -> dict:
    return means_summary(samples, ("ocr", "ocr_exact"))


def _geneval_table(protocol: Protocol, samples: list[dict]) -> dict:
    return geneval_summary(samples)


def _geneval_test_table(protocol: Protocol, samples: list[dict]) -> dict:
    return geneval_image_summary(samples)


PROTOCOLS = {
    p.name: p
    for p in [
        Protocol("geneval", "geneval/eval", 4, ("geneval",), "GenEval (arXiv:2310.11513), summary_scores.py",
                 {"geneval": {"score": "geneval"}}, _geneval_table),
        Protocol("geneval_test", "geneval/test", 1, ("geneval",),
                 "DiffusionNFT's GenEval column (arXiv:2509.16117), scripts/evaluation.py --dataset geneval",
                 {"geneval": {"score": "geneval", "detector_channels": "bgr"}}, _geneval_test_table),
        Protocol("ocr", "ocr/test", 1, ("ocr",), "flow_grpo's OCR test accuracy (arXiv:2505.05470)",
                 {"ocr": {"engine": "paddleocr"}}, _ocr_means),
        Protocol("drawbench", "drawbench", 5, NFT_REWARDS,
                 "DiffusionNFT's DrawBench table (arXiv:2509.16117), evaluation.py --dataset drawbench",
                 {"unifiedreward": UNIFIEDREWARD}, columns=NFT_COLUMNS,
                 reward_names={"unifiedreward": "vlm_judge"}),
        Protocol("pickscore", "pickscore/test", 1, NFT_REWARDS,
                 "DiffusionNFT's PickScore-test table (arXiv:2509.16117), evaluation.py --dataset pickscore",
                 {"unifiedreward": UNIFIEDREWARD}, columns=NFT_COLUMNS,
                 reward_names={"unifiedreward": "vlm_judge"}),
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
def score_protocol(
    session, protocol: Protocol, items, images_per_prompt: int, write_image=None, rendered=None
) -> list[dict]:
    """Every prompt's images generated and scored (:func:`~diffrl.inference.generate.generate_and_score`,
    each prompt encoded on its own, so the table of N processes is the table of one), each
    image handed to ``write_image`` where given; every process gets every sample back, in
    plan order, as ``{index, prompt, group, seed, scores}``. ``rendered`` (paraphrases,
    one per item) conditions the images on other text from the same noise keys, still
    judged against the items' prompts."""
    from diffrl.inference.generate import GenerationSettings, generate_and_score, plan_samples

    prompts, groups = [p for p, _ in items], [g for _, g in items]
    samples = plan_samples(prompts, list(range(images_per_prompt)), protocol.name, groups, rendered)
    settings = GenerationSettings.of(session.cfg)
    scored = generate_and_score(session, samples, settings, encode_alone=True, write_image=write_image)
    return [
        {"index": x.sample.index, "prompt": x.sample.prompt, "group": x.sample.group, "seed": x.sample.seed,
         "scores": x.scores, **({} if x.sample.rendered is None else {"rendered": x.sample.rendered})}
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


def columns_summary(samples: list[dict], columns) -> dict:
    """A paper's columns: each present column's mean and SE over prompts, overall and by
    group, its score times the column's scale."""
    present = samples[0]["scores"] if samples else {}
    scaled = [
        {**s, "scores": {c.label: s["scores"][c.key] * c.scale for c in columns if c.key in s["scores"]}}
        for s in samples
    ]
    return means_summary(scaled, [c.label for c in columns if c.key in present])


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


def geneval_image_summary(samples: list[dict]) -> dict:
    """DiffusionNFT's printout of ``--dataset geneval``: ``accuracy``, GenEval's verdict
    averaged over images, ``strict_accuracy`` (flow_grpo's), each task's ``accuracy`` over
    its images; and GenEval's overall (the mean over tasks) beside it."""
    rows = [["images", len(samples), None, len(samples)]]
    for key, label in (("geneval_correct", "accuracy"), ("geneval_strict", "strict_accuracy")):
        values = [s["scores"][key] for s in samples]
        mean, se = _mean_se(values, [s["index"] for s in samples])
        rows.append([f"{label} (mean over images)", mean, se, len(values)])
    task_scores = []
    for task in dict.fromkeys(s["group"] for s in samples):
        picked = [s for s in samples if s["group"] == task]
        mean, se = _mean_se([s["scores"]["geneval_correct"] for s in picked], [s["index"] for s in picked])
        task_scores.append(mean)
        rows.append([f"{task}_accuracy", mean, se, len(picked)])
    rows.append(["overall (mean over tasks)", sum(task_scores) / len(task_scores), None, len(samples)])
    return {"rows": rows, "headline": {"geneval accuracy": rows[1][1]}}


def markdown(summary: dict, title: str) -> str:
    """The table (and, after ``--paraphrases``, the paraphrases' table and the gap of
    each headline score)."""
    lines = [f"### {title}", "", *_table_lines(summary["rows"])]
    para = summary.get("paraphrases")
    if para:
        lines += [
            "",
            f"#### the same prompts paraphrased ({para['source']}), judged against their originals",
            "",
        ]
        lines += _table_lines(para["rows"])
        lines += [
            "",
            "| headline | original | paraphrased | gap (original - paraphrased) |",
            "|---|---|---|---|",
        ]
        for name, gap in para["gap"].items():
            lines.append(
                f"| {name} | {summary['headline'][name]:.4f} | {para['headline'][name]:.4f} | {gap:+.4f} |"
            )
    return "\n".join(lines)


def _table_lines(rows) -> list[str]:
    lines = ["| measure | value | SE | n |", "|---|---|---|---|"]
    for label, value, se, n in rows:
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"| {label} | {shown} | {'' if se is None or math.isnan(se) else f'{se:.4f}'} | {n} |")
    return lines
