"""Running a paper's evaluation protocol on a model: ``scripts/evaluate.py --protocol``.

The model is a config's (``model.pretrained``, its sampler and resolution) in an
inference session (:mod:`diffrl.inference.session`), plus a diffrl checkpoint (its
evaluated weights by default: the EMA where the run kept one, as training scored them;
its optimizer and RNG state are never read) or a LoRA from elsewhere
(:func:`diffrl.models.lora_files.load_outside_lora`). The prompts are the protocol's set
unless ``prompts`` names another set or file; ``limit`` takes the first N prompts.
Rewards are the protocol's; ``rewards`` picks a subset and ``reward_args``
(``NAME.KEY=VALUE``) gives their arguments. Prints the settings before it starts; writes
``<out>/<protocol>.md`` (the table), ``<out>/<protocol>.json`` (the table, the settings,
every image's scores) and, unless ``save_images`` is off, every image under
``<out>/<protocol>_images`` in GenEval's layout (:mod:`diffrl.evaluation.protocol_images`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from diffrl.config import ConfigError
from diffrl.evaluation import json_out
from diffrl.evaluation import protocols as P
from diffrl.evaluation.protocol_images import ImageWriter


@dataclass(frozen=True)
class ProtocolRun:
    """One protocol run, as ``scripts/evaluate.py --protocol`` asks for it."""

    protocol: str  # a name of :data:`~diffrl.evaluation.protocols.PROTOCOLS`
    config: str | None = None  # the config (name or path); None: the checkpoint's own
    overrides: tuple[str, ...] = ()  # --set KEY=VALUE on top of it
    checkpoint: str = "base"  # 'base' or a checkpoint / export directory
    weights: str = "evaluated"  # a checkpoint's evaluated, trained or ema weights
    lora: str | None = None  # a LoRA from elsewhere: a PEFT or diffusers folder, a file or a hub id
    prompts: str | None = None  # another prompt set or file than the protocol's
    # a paraphrase file (docs/DATA.md): its originals scored as the protocol's prompts and its
    # paraphrases from the same noise, both judged against the originals (prompt overfitting)
    paraphrases: str | None = None
    limit: int = 0  # the first N prompts only (0: all)
    images: int = 0  # images per prompt (0: the protocol's)
    rewards: tuple[str, ...] = ()  # a subset of the protocol's rewards (empty: all)
    reward_args: tuple[str, ...] = ()  # NAME.KEY=VALUE
    out: str = "outputs/eval"
    save_images: bool = True  # every image under <out>/<protocol>_images

    @property
    def images_per_prompt(self) -> int:
        return self.images or P.PROTOCOLS[self.protocol].images_per_prompt


def reward_specs(protocol: P.Protocol, names, args) -> list[dict]:
    """The protocol's rewards (or ``names``, a subset of its keys), with ``NAME.KEY=VALUE``
    args; a key that is not its reward's registry name is the reward's label."""
    chosen = list(names) if names else list(protocol.rewards)
    unknown = [n for n in chosen if n not in protocol.rewards]
    if unknown:
        raise ConfigError(
            f"--rewards: '{unknown[0]}' is not a reward of protocol {protocol.name}; "
            f"choose from {', '.join(protocol.rewards)}"
        )
    specs = {n: _spec(protocol, n) for n in chosen}
    for item in args:
        target, eq, value = item.partition("=")
        name, dot, key = target.partition(".")
        if not (eq and dot) or name not in specs:
            raise ConfigError(
                f"--reward-arg '{item}': use NAME.KEY=VALUE with NAME one of {', '.join(specs)}"
            )
        specs[name]["args"][key] = yaml.safe_load(value)
    return list(specs.values())


def _spec(protocol: P.Protocol, key: str) -> dict:
    spec = {"name": protocol.reward_names.get(key, key), "args": dict(protocol.reward_args.get(key, {}))}
    return {**spec, "label": key} if spec["name"] != key else spec


def protocol_config(request: ProtocolRun):
    """The config a protocol run reads: its ``--config`` (or the checkpoint's own), with the
    protocol's rewards and prompts in place of the run's."""
    import dataclasses

    from diffrl.config import RewardSpec, load_config
    from diffrl.inference.checkpoints import find_checkpoint

    protocol = P.PROTOCOLS[request.protocol]
    if request.config is not None:
        cfg = load_config(request.config, list(request.overrides))
    elif request.checkpoint != "base":
        cfg = load_config(str(find_checkpoint(request.checkpoint) / "config.yaml"), list(request.overrides))
    else:
        raise ConfigError("--protocol with --checkpoint base needs --config (the model to score)")
    if not (request.prompts or protocol.prompts) and cfg.data.eval_holdout:
        raise ConfigError(
            f"protocol '{protocol.name}' scores the config's evaluation file, but this config holds its "
            f"{cfg.data.eval_holdout} evaluation prompts out of data.train_prompts (data.eval_holdout): "
            "name the prompts with --prompts FILE_OR_SET"
        )
    if request.paraphrases and request.prompts:
        raise ConfigError("--paraphrases names the prompts (their originals) itself: drop --prompts")
    source = request.paraphrases or request.prompts or protocol.prompts or cfg.data.eval_prompts
    rewards = [RewardSpec(**spec) for spec in reward_specs(protocol, request.rewards, request.reward_args)]
    data = dataclasses.replace(cfg.data, train_prompts=source, eval_prompts=source, eval_holdout=0)
    return dataclasses.replace(cfg, rewards=rewards, data=data)


def preflight_protocol(request: ProtocolRun) -> None:
    """Everything the protocol reads (model, LoRA, every reward's files, the prompt set),
    checked at once before a model loads; what it cannot fetch stops it in one list, each
    fix phrased as the ``--reward-arg`` it takes (issue 62, item 5: DrawBench took five runs
    to find five missing rewards)."""
    from diffrl.inference.preflight import stop_if_missing

    stop_if_missing(
        protocol_config(request),
        f"scripts/evaluate.py --protocol {request.protocol} lists this again when run",
        reward_arg_style=True,
    )


def open_session(request: ProtocolRun):
    """The inference session that scores ``request``: its config, the protocol's rewards,
    the checkpoint's weights or an outside LoRA."""
    from diffrl.config import RewardSpec
    from diffrl.inference.session import Session, session_for_checkpoint

    protocol = P.PROTOCOLS[request.protocol]
    rewards = [RewardSpec(**spec) for spec in reward_specs(protocol, request.rewards, request.reward_args)]
    if request.checkpoint != "base":
        session = session_for_checkpoint(
            request.checkpoint, request.config, request.overrides, request.weights, rewards=rewards
        )
    else:
        from diffrl.config import load_config

        if request.config is None:
            raise ConfigError("--protocol with --checkpoint base needs --config (the model to score)")
        session = Session(load_config(request.config, list(request.overrides)), rewards=rewards)
    if request.lora:
        session.load_outside_lora(request.lora)
    return session


def settings_of(session) -> dict:
    cfg = session.cfg
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
        "rewards": [{"name": name, "args": args} for name, args in _reward_args(session)],
    }


def _reward_args(session) -> list[tuple[str, dict]]:
    return [(spec.name, dict(spec.args)) for spec in session.reward_specs]


def run(request: ProtocolRun) -> dict | None:
    """Run ``request``'s protocol; the main process writes and returns the result."""
    protocol = P.PROTOCOLS[request.protocol]
    preflight_protocol(request)  # everything it reads, before a model loads
    session = open_session(request)
    source, items, rendered = protocol_prompts(request, protocol, session)
    session.reward_fn.check_prompts([prompt for prompt, _ in items], source)
    images = Path(request.out) / f"{protocol.name}_images" if request.save_images else None
    head = {
        "protocol": protocol.name,
        "reference": protocol.reference,
        "prompts": {"source": source, "sha256": _recorded_sha(source), "count": len(items)},
        "images_per_prompt": request.images_per_prompt,
        "checkpoint": request.checkpoint,
        "lora": request.lora,
        "images": None if images is None else str(images),
        "settings": settings_of(session),
    }
    session.acc.print(yaml.safe_dump(head, sort_keys=False, width=110).rstrip())  # what is about to run
    writer = None if images is None else ImageWriter(images)
    scored = P.score_protocol(session, protocol, items, request.images_per_prompt, writer)
    paraphrased = None
    if rendered is not None:  # the same prompts paraphrased, from the same noise
        folder = None if images is None else images.with_name(f"{protocol.name}_paraphrase_images")
        writer = None if folder is None else ImageWriter(folder)
        paraphrased = P.score_protocol(session, protocol, items, request.images_per_prompt, writer, rendered)
    if not session.acc.is_main_process:
        return None
    result = {**head, **P.summarise(protocol, scored), "samples": scored}
    if paraphrased is not None:
        result["paraphrases"] = paraphrase_summary(protocol, result, paraphrased, source)
    write(result, Path(request.out), protocol.name)
    return result


def protocol_prompts(request: ProtocolRun, protocol: P.Protocol, session):
    """(source, [(prompt, group)], the paraphrases rendered in their place or None): the
    protocol's set, ``--prompts``, or a paraphrase file's originals and paraphrases."""
    source = request.paraphrases or request.prompts or protocol.prompts or session.cfg.data.eval_prompts
    if not request.paraphrases:
        return source, P.protocol_items(protocol, source)[: request.limit or None], None
    from diffrl.data.prompts import read_paraphrases

    pairs = read_paraphrases(source)[: request.limit or None]
    return source, [(pair.judged, pair.group) for pair in pairs], [pair.rendered for pair in pairs]


def paraphrase_summary(protocol: P.Protocol, result: dict, paraphrased: list[dict], source: str) -> dict:
    """The protocol's table over the paraphrased images, and the gap of each headline
    score (the originals' minus the paraphrases'): how much of the score the wording the
    model was trained on carries."""
    table = P.summarise(protocol, paraphrased)
    gap = {name: result["headline"][name] - value for name, value in table["headline"].items()}
    return {"source": source, **table, "gap": gap, "samples": paraphrased}


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
    (out / f"{name}.json").write_text(json_out.dumps(result, indent=1, default=str) + "\n")
    print(table)
    print(f"\nwrote {out / f'{name}.md'} and {out / f'{name}.json'}")
