"""Running a paper's evaluation protocol on a model: ``scripts/evaluate.py --protocol``.

The model is a config's (``model.pretrained``, its sampler and resolution), plus a diffrl
checkpoint (loaded as ``--resume`` loads it, its EMA weights scored as training scores
them) or a LoRA from elsewhere (:mod:`diffrl.models.lora_files`). The prompts are
the protocol's set unless ``--prompts`` names another set or file; ``--limit`` takes the
first N prompts. Rewards are the protocol's; ``--rewards`` picks a subset and
``--reward-arg NAME.KEY=VALUE`` gives their weights. Writes ``<out>/<protocol>.md`` (the
table) and ``<out>/<protocol>.json`` (the table, the settings, every image's scores).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

import yaml

from diffrl.config import ConfigError
from diffrl.evaluation import protocols as P


def reward_specs(protocol: P.Protocol, names: str | None, args: list[str]) -> list[dict]:
    """The protocol's rewards (or the comma list ``names``), with ``NAME.KEY=VALUE`` args."""
    chosen = names.split(",") if names else list(protocol.rewards)
    specs = {n: {"name": n, "args": dict(protocol.reward_args.get(n, {}))} for n in chosen}
    for item in args:
        target, eq, value = item.partition("=")
        name, dot, key = target.partition(".")
        if not (eq and dot) or name not in specs:
            raise ConfigError(
                f"--reward-arg '{item}': use NAME.KEY=VALUE with NAME one of {', '.join(specs)}"
            )
        specs[name]["args"][key] = yaml.safe_load(value)
    return list(specs.values())


def source_of(protocol: P.Protocol, prompts: str | None, cfg) -> str:
    return prompts or protocol.prompts or cfg.data.eval_prompts


def build_trainer(a, protocol: P.Protocol, run_dir: str):
    """A Trainer for ``a.config`` scoring with the protocol's rewards on its prompts."""
    from diffrl.config import load_config
    from diffrl.training.trainer import Trainer

    base = load_config(a.config, list(a.overrides))
    source = source_of(protocol, a.prompts, base)
    rewards = json.dumps(reward_specs(protocol, a.rewards, a.reward_args))
    quiet = [f"output_dir={run_dir}", "logging.trackers=[]", "perf.compile_rollout=false"]
    quiet += ["eval.every=0", "eval.at_start=false", f"data.train_prompts={source}", f"rewards={rewards}"]
    trainer = Trainer(load_config(a.config, quiet + list(a.overrides)))
    if a.checkpoint != "base":
        trainer.resume(a.checkpoint)
    if a.lora:
        from diffrl.models.lora_files import load_outside_lora

        load_outside_lora(trainer.adapter.transformer, a.lora, log=trainer.acc.print)
    return trainer, source


def settings_of(trainer) -> dict:
    cfg = trainer.cfg
    return {
        "model": cfg.model.pretrained,
        "init_lora": cfg.model.init_lora,
        "resolution": [cfg.model.height, cfg.model.width],
        "num_frames": cfg.model.num_frames,
        "eval_num_steps": cfg.sampling.eval_num_steps or cfg.sampling.num_steps,
        "guidance_scale": cfg.model.guidance_scale
        if cfg.eval.guidance_scale is None
        else cfg.eval.guidance_scale,
        "sampler": "ODE (Euler), deterministic given the seed",
        "dtype": cfg.model.dtype,
        "mixed_precision": cfg.train.mixed_precision,
        "batch_size": cfg.rollout.batch_size,
        "rewards": [{"name": r.name, "args": dict(r.args)} for r in cfg.rewards],
    }


def run(a) -> dict | None:
    """Run protocol ``a.protocol``; the main process writes and returns the result."""
    from diffrl.sampling.settings import SamplerSettings

    protocol = P.PROTOCOLS[a.protocol]
    with tempfile.TemporaryDirectory() as tmp:
        trainer, source = build_trainer(a, protocol, tmp)
        items = P.protocol_items(protocol, source)[: a.limit or None]
        samples = P.plan(items, a.images or protocol.images_per_prompt, protocol.name)
        sampler = SamplerSettings.of(trainer.cfg).for_evaluation()
        steps = trainer.cfg.sampling.eval_num_steps or trainer.cfg.sampling.num_steps
        ema = trainer.ema.swapped_in() if (trainer.ema is not None and a.checkpoint != "base") else None
        guidance = trainer.adapter.guidance_scale_as(trainer.cfg.eval.guidance_scale)
        with ema or contextlib.nullcontext(), guidance:
            args = (trainer.acc, trainer.adapter, trainer.adapter.transformer, trainer.reward_fn)
            scored = P.score_samples(*args, samples, sampler, steps)
        if not trainer.acc.is_main_process:
            return None
        result = {
            "protocol": protocol.name,
            "reference": protocol.reference,
            "prompts": {"source": source, "sha256": _recorded_sha(source), "count": len(items)},
            "images_per_prompt": a.images or protocol.images_per_prompt,
            "checkpoint": a.checkpoint,
            "lora": a.lora,
            "settings": settings_of(trainer),
            **P.summarise(protocol, scored),
            "samples": scored,
        }
    write(result, Path(a.out), protocol.name)
    return result


def _recorded_sha(source: str) -> list[str] | None:
    """The sha256 a fetched set's files were verified with (None for a plain file)."""
    from diffrl.data import is_set_name, local_files

    if not is_set_name(source):
        return None
    records = [p.with_name(p.name + ".verified") for p in local_files(source)]
    return [json.loads(r.read_text())["sha256"] for r in records]


def write(result: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    title = f"{name}: {result['settings']['model']}" + (f" + {result['lora']}" if result["lora"] else "")
    title += "" if result["checkpoint"] == "base" else f" @ {result['checkpoint']}"
    table = P.markdown(result, title)
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(table)
    print(f"\nwrote {out / f'{name}.md'} and {out / f'{name}.json'}")
