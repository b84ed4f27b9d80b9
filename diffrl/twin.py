"""Run any config on its family's tiny twin (``train.py --tiny-twin``): every algorithm
setting (sampler, steps, tree, Sol-RL, objective, advantages, group sizes) is kept, and
only what needs real weights or a GPU is swapped: the model becomes the offline tiny
twin at 32x32 in fp32, one prompt per iteration, weight-free rewards in place of model
rewards. A real-model config can so be proven offline in seconds (the CI does it for
every shipped one).

``train.py --full-size`` is the opposite swap: everything the config says is kept,
including resolution, batch sizes and LoRA, and only the weights change, to the published
architecture with random weights (``random:<arch>``, :mod:`diffrl.models.arch`), with the
same weight-free reward stand-ins. Its transformer and VAE times and memory are the
config's real ones; the text encoders are the twin's (widened to the published output
width) and the reward models are stand-ins, so the real encoders' and rewards' memory
(T5-XXL alone is about 9.5 GB in bf16) and scoring time come on top: the meta-device
estimate (``bench_rollout.py --sections estimate``) adds them.
"""

from __future__ import annotations

import json

# what every smoke or measurement run switches off: evaluation, checkpoints, trackers
QUIET_RUN = ("eval.every=0", "eval.at_start=false", "checkpoint.every=0", "logging.trackers=[]")
WEIGHT_FREE = (
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "shapeworld",
    "shapeworld_edit",
    "shapeworld_video",
    "random_control",
)
# three distinct stand-ins: a config of three model rewards (DiffusionNFT's) keeps three
_STAND_INS = ("jpeg_compressibility", "jpeg_incompressibility", "random_control")


def _rewards(cfg) -> list[dict]:
    """The config's rewards with model rewards swapped for distinct weight-free ones."""
    return _stand_ins(cfg.rewards)


def _gold(cfg) -> str:
    """The ``eval.gold`` override: the gold panel's model rewards swapped the same way."""
    return f"eval.gold={json.dumps(_stand_ins(cfg.eval.gold))}"


def _stand_ins(specs) -> list[dict]:
    used = {r.name for r in specs if r.name in WEIGHT_FREE}
    spare = [n for n in _STAND_INS if n not in used]
    out = []
    for r in specs:
        args = dict(r.args)
        if r.name == "video_frames":
            if args.get("reward", "jpeg_compressibility") not in WEIGHT_FREE:
                args = {**args, "reward": "jpeg_compressibility", "args": {}}
            out.append({"name": r.name, "weight": r.weight, "args": args})
        elif r.name in WEIGHT_FREE:
            out.append({"name": r.name, "weight": r.weight, "args": args})
        elif spare:
            out.append({"name": spare.pop(0), "weight": r.weight})
    return out


def _prompt_files(family: str, holdout: int = 0) -> list[str]:
    """The tiny prompt sets; an editing family gets the ShapeWorld edits (with images)."""
    from diffrl.models import adapter_class

    if adapter_class(family).edits_images:
        train, held = "assets/shapeworld/edit/train.jsonl", "assets/shapeworld/edit/heldout.jsonl"
    else:
        train, held = "assets/prompts/tiny_train.txt", "assets/prompts/tiny_eval.txt"
    # the tiny files are split already: a holdout of the training file would empty it
    return [f"data.train_prompts={train}", f"data.eval_prompts={held}"] + (
        ["data.eval_holdout=0"] if holdout else []
    )


def tiny_twin_overrides(cfg, processes: int = 1) -> list[str]:
    """``--set`` assignments that turn ``cfg`` into its tiny-twin smoke run."""
    from diffrl.algorithms import get_objective
    from diffrl.models import adapter_class

    video = adapter_class(cfg.model.family).is_video_family()
    # an objective trained on whole groups (DGPO) needs a micro-batch of whole groups
    micro_batch = cfg.rollout.group_size if get_objective(cfg.objective.name).whole_groups else 4
    return [
        "model.pretrained=tiny",
        "model.height=32",
        "model.width=32",
        f"model.num_frames={5 if video else 1}",
        "model.max_sequence_length=16",
        "model.dtype=float32",
        "model.lora.rank=4",
        "model.lora.alpha=8.0",
        "model.lora.target_modules=null",
        "train.mixed_precision='no'",
        f"rollout.prompts_per_step={processes}",
        "rollout.batch_size=16",
        f"train.micro_batch_size={micro_batch}",
        "train.gradient_accumulation=1",
        "train.max_steps=1",
        # compiling pays on a GPU; on the CPU a twin's smoke run would spend its time in inductor
        "perf.compile_rollout=false",
        *_prompt_files(cfg.model.family, cfg.data.eval_holdout),
        *QUIET_RUN,
        f"run_name={cfg.run_name}_tiny_twin",
        f"rewards={json.dumps(_rewards(cfg))}",
        _gold(cfg),
        *_refiner_twin(cfg),
    ]


def _refiner_twin(cfg) -> list[str]:
    """PromptRL's refiner as its tiny twin (the real LM's template, format reward and loss;
    short rewrites): a twin run or a full-size one on random weights fetches no LM."""
    if cfg.refiner.model is None:
        return []
    return ["refiner.model=tiny", "refiner.dtype=float32", "refiner.max_new_tokens=8"]


def full_size_overrides(cfg, steps: int = 2) -> list[str]:
    """``--set`` assignments that run ``cfg`` at full size on random weights for ``steps``
    iterations, with no evaluation, checkpoints or trackers."""
    from diffrl.config import ConfigError
    from diffrl.models.arch import RANDOM_PREFIX, arch_for

    arch = arch_for(cfg.model.pretrained)
    if arch is None:
        raise ConfigError(
            f"no shipped architecture matches model.pretrained '{cfg.model.pretrained}'; "
            "pass --set model.pretrained=random:<arch> with one of assets/arch/*.json"
        )
    return [
        f"model.pretrained={RANDOM_PREFIX}{arch.name}",
        f"train.max_steps={steps}",
        *QUIET_RUN,
        # random weights measure speed and memory, not prompts: the shipped ones, no fetch
        *_prompt_files(cfg.model.family, cfg.data.eval_holdout),
        f"run_name={cfg.run_name}_full_size",
        f"rewards={json.dumps(_rewards(cfg))}",
        _gold(cfg),
        # the refiner LM is not part of the full-size measurement: its tiny twin stands in
        *_refiner_twin(cfg),
    ]
