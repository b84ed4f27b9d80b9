"""Experiment trackers as the peers use them (flow_grpo and Flow-Factory log to W&B): the
run under a configurable project and entity with its own name, the resolved config as
hyperparameters, each evaluation's sample sheet and its first images one by one with the
prompt and the reward in the caption, and the evaluation's table of prompts, seeds,
images and scores. TensorBoard gets the scalars and hyperparameters; ``metrics.jsonl``
holds everything in any case.

A tracker named in ``logging.trackers`` that is not installed stops the run at start with
one line (``pip install 'diffrl[wandb]'``): a run that was meant to be watched and is not
is found out hours later otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import uuid
from pathlib import Path

from diffrl.config import ConfigError

_PIP = {"wandb": "pip install 'diffrl[wandb]'", "tensorboard": "pip install tensorboard"}


def check_trackers(names: list[str]) -> list[str]:
    """``names``, each installed; one error naming the first that is not, and its install."""
    for name in names:  # accelerate's tracker names are their packages' import names
        if importlib.util.find_spec(name) is None:
            fix = _PIP.get(name, f"pip install {name}")
            raise ConfigError(
                f"logging.trackers names '{name}', which is not installed: {fix}, or drop it from "
                "logging.trackers (metrics.jsonl is written in any case)"
            )
    return list(names)


def hyperparameters(cfg) -> dict:
    """The resolved config as flat ``section.key`` values TensorBoard and W&B both take
    (lists and mappings as JSON text)."""
    out = {}

    def walk(node, prefix: str) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                walk(value, key + ".")
            elif isinstance(value, (list, tuple, dict)):
                out[key] = json.dumps(_plain(value), default=str)
            elif value is None or isinstance(value, (bool, int, float, str)):
                out[key] = value
            else:
                out[key] = str(value)

    walk(cfg, "")
    return out


def _plain(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of this run directory: made at the first start and kept in
    ``RUN/wandb_run_id``, so ``--resume`` continues the same W&B run instead of starting a
    second one (issue 62, item 9)."""
    path = Path(run_dir) / WANDB_ID_FILE
    if path.is_file() and (known := path.read_text().strip()):
        return known
    made = uuid.uuid4().hex[:12]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(made + "\n")
    return made


def wandb_init_kwargs(cfg) -> dict:
    """``wandb.init`` arguments: the run's name, tags and entity, its kept id with
    ``resume="allow"``, and its files under ``WANDB_DIR`` when that is set (W&B's own
    variable, which an explicit ``dir`` would override), else in the run directory."""
    lc = cfg.logging
    kwargs = {
        "name": cfg.run_name,
        "dir": os.environ.get("WANDB_DIR") or str(cfg.run_dir),
        "tags": list(lc.tags),
        "id": wandb_run_id(cfg.run_dir),
        "resume": "allow",
    }
    if lc.entity:
        kwargs["entity"] = lc.entity
    return kwargs


def init_trackers(accelerator, cfg) -> None:
    """Start the configured trackers: W&B under ``logging.project`` (:func:`wandb_init_kwargs`),
    TensorBoard under ``logs/<project>``."""
    lc = cfg.logging
    kwargs = (
        {"wandb": wandb_init_kwargs(cfg)} if "wandb" in lc.trackers and accelerator.is_main_process else {}
    )
    accelerator.init_trackers(lc.project, config=hyperparameters(cfg), init_kwargs=kwargs)


def log_evaluation_media(accelerator, step: int, media: dict | None, prefix: str = "eval") -> None:
    """An evaluation's sample sheet, its first images with prompt and reward in each caption,
    and their table, to W&B (the main process; nothing without a W&B tracker)."""
    if not media or not accelerator.is_main_process:
        return
    # by name among the running trackers: accelerate's get_tracker hands back a blank
    # stand-in when none runs at all (logging.trackers: []), and wandb may not be installed
    running = [t for t in accelerator.trackers if t.name == "wandb"]
    if not running:
        return
    tracker = running[0].tracker
    import wandb

    images = [
        wandb.Image(image, caption=caption) for image, caption in zip(media["images"], media["captions"])
    ]
    columns = ["prompt", "seed", "image", *media["score_names"]]
    rows = [
        [prompt, seed, image, *scores]
        for prompt, seed, image, scores in zip(media["prompts"], media["seeds"], images, media["scores"])
    ]
    logged = {f"{prefix}/samples": images, f"{prefix}/table": wandb.Table(columns=columns, data=rows)}
    if media.get("sheet") is not None:
        logged[f"{prefix}/sheet"] = wandb.Image(str(media["sheet"]))
    tracker.log(logged, step=step)
