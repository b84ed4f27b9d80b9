"""An inference session: the inputs (prompts, rewards) and the policy that a config or a
checkpoint describes, and nothing that training adds: no optimizer, no
``accelerate.prepare``, no precision patching, no compilation.

The trainer composes one (``Session(cfg, accelerator, prompts=...)``) and builds training
on top of its policy; evaluations, the papers' protocols, comparison grids, probes and
benchmarks build one alone, from a config or from a checkpoint
(:func:`session_for_checkpoint`: the checkpoint's own config by default, its evaluated,
trained or EMA weights, never its optimizer or RNG state), and sample through
:func:`diffrl.inference.generate.generate_and_score`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from pathlib import Path

from diffrl.data.prompts import (
    check_image_column,
    holdout_split,
    load_prompts,
    read_paraphrases,
    spaced_subset,
)
from diffrl.inference.checkpoints import CheckpointError, settings_differences
from diffrl.inference.weights import holds_weights, load_refiner_weights, load_weights, saved_ema_decay
from diffrl.models import adapter_class, build_adapter
from diffrl.models.policy import Policy
from diffrl.runtime.attention import apply_attention_backend
from rewards.combine import MultiReward

PROMPT_SETS = ("train", "eval")


def inference_accelerator(cfg):
    """An Accelerator for sampling only: the run's autocast and process group, no trackers."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=cfg.train.collective_timeout_minutes))
    return Accelerator(mixed_precision=cfg.train.mixed_precision, kwargs_handlers=[timeout])


class Session:
    """The policy of ``cfg`` and the inputs it is sampled and scored on.

    ``prompts``: the prompt sets (``train``, ``eval``) read and checked before any model is
    built, so a bad file fails first; the others are read when first asked for. ``rewards``:
    reward specs in place of ``cfg.rewards`` (a protocol's). ``keep_on_host``: leave the
    transformer and rewards in host memory (FSDP's ``prepare`` places them; training only).
    """

    def __init__(self, cfg, accelerator=None, *, prompts=(), rewards=None, keep_on_host: bool = False):
        unknown = sorted(set(prompts) - set(PROMPT_SETS))
        if unknown:
            raise ValueError(f"prompt sets {unknown}: choose from {PROMPT_SETS}")
        self.cfg = cfg
        self.acc = accelerator if accelerator is not None else inference_accelerator(cfg)
        self.reward_fn = None
        for name in PROMPT_SETS:  # in this order: a bad training file is named first
            if name in prompts:
                getattr(self, f"{name}_prompts")
        self.reward_specs = list(cfg.rewards if rewards is None else rewards)
        self.reward_fn = MultiReward(self.reward_specs)
        # the gold panel: rewards the evaluation scores and the run does not optimise
        self.gold_fn = MultiReward(list(cfg.eval.gold)) if cfg.eval.gold else None
        for name in PROMPT_SETS:
            if name in prompts:
                self._check_rewards(getattr(self, f"{name}_prompts"), self._source(name))
        self._build_policy(keep_on_host)

    # -- inputs ---------------------------------------------------------------------------
    def _source(self, name: str) -> str:
        return getattr(self.cfg.data, f"{name}_prompts")

    @functools.cached_property
    def _train_file_split(self) -> tuple[list[str], list[str]]:
        """The training file's prompts as (trained on, held out by ``data.eval_holdout``)."""
        data = self.cfg.data
        prompts = self.read_prompts(data.train_prompts)
        return (
            holdout_split(prompts, data.eval_holdout, data.train_prompts)
            if data.eval_holdout
            else (prompts, [])
        )

    @functools.cached_property
    def train_prompts(self) -> list[str]:
        return self._train_file_split[0]

    @functools.cached_property
    def eval_prompts(self) -> list[str]:
        """The held-out prompts an evaluation scores: ``eval.num_prompts`` of the file (or of
        the prompts ``data.eval_holdout`` keeps out of training), its first ones or evenly
        spaced (``eval.subset``); asking for more than there are scores them all, and says
        so once."""
        cfg = self.cfg
        if cfg.data.eval_holdout:
            prompts, source = (
                self._train_file_split[1],
                f"the {cfg.data.eval_holdout} held out by data.eval_holdout",
            )
        else:
            prompts = self.read_prompts(cfg.data.eval_prompts)
            source = f"data.eval_prompts '{cfg.data.eval_prompts}' holds {len(prompts)}"
        wanted = cfg.eval.num_prompts
        if wanted > len(prompts):
            every = f"every evaluation scores all {len(prompts)}"
            self.acc.print(f"warning: eval.num_prompts is {wanted} but {source}: {every}")
        return spaced_subset(prompts, wanted) if cfg.eval.subset == "spaced" else prompts

    @functools.cached_property
    def train_eval_prompts(self) -> list[str]:
        """The fixed, evenly spaced subset of the training prompts an evaluation also scores
        (``eval.train_num_prompts``; none when 0)."""
        count = self.cfg.eval.train_num_prompts
        return spaced_subset(self.train_prompts, count) if count else []

    @functools.cached_property
    def eval_paraphrases(self) -> list:
        """The paraphrases an evaluation also scores (``eval.paraphrases``, evenly spaced
        ``eval.paraphrase_num_prompts`` of them; none when unset). The originals are checked
        as any prompt is; the paraphrases only for what the model takes, since no reward
        reads them."""
        source = self.cfg.eval.paraphrases
        if not source:
            return []
        pairs = read_paraphrases(source)
        self.check_prompts([p.judged for p in pairs], source)
        family = self.cfg.model.family
        check_image_column([p.rendered for p in pairs], source, family, adapter_class(family).edits_images)
        count = self.cfg.eval.paraphrase_num_prompts
        return spaced_subset(pairs, count) if count else pairs

    def read_prompts(self, source) -> list[str]:
        """The prompts of ``source`` (a file or a prompt set), checked (:meth:`check_prompts`)."""
        prompts = load_prompts(source)
        self.check_prompts(prompts, source)
        return prompts

    def check_prompts(self, prompts: list[str], source) -> None:
        """Refuse ``prompts`` (read from ``source``) that the model family cannot take
        (input images for editing families only) or, once the rewards exist, that they
        cannot score."""
        family = self.cfg.model.family
        check_image_column(prompts, source, family, adapter_class(family).edits_images)
        self._check_rewards(prompts, source)

    def _check_rewards(self, prompts: list[str], source) -> None:
        for rewards in (self.reward_fn, getattr(self, "gold_fn", None)):
            if rewards is not None:
                rewards.check_prompts(prompts, str(source))

    def rewards_to(self, device) -> None:
        """The trained rewards and the gold panel onto ``device``."""
        for rewards in (self.reward_fn, self.gold_fn):
            if rewards is not None:
                rewards.to(device)

    # -- the policy -----------------------------------------------------------------------
    def _build_policy(self, keep_on_host: bool) -> None:
        """The adapter and its policy (LoRA injected, ``model.init_lora`` loaded), on the
        process's device unless ``keep_on_host``; the attention backend the config names."""
        cfg = self.cfg
        self.adapter = build_adapter(cfg.model)
        if not keep_on_host:
            self.adapter.to(self.acc.device)
            self.rewards_to(self.acc.device)
        self.policy = Policy(self.adapter, cfg.model, cfg.seed, upcast_trainable=not keep_on_host)
        apply_attention_backend(self.adapter.transformer, cfg.perf.attention_backend)
        self.refiner = None  # PromptRL's prompt refiner (refiner.model), in front of the flow model
        if cfg.refiner.model is not None:
            from diffrl.models.refiner import PromptRefiner

            self.refiner = PromptRefiner.build(cfg.refiner, self.acc.device, seed=cfg.seed)

    def load_weights(self, path, which: str = "evaluated") -> str:
        """Weights from a checkpoint or export (:func:`diffrl.inference.weights.load_weights`);
        says which were loaded."""
        what = load_weights(self.policy, path, which, self.cfg.model)
        if self.refiner is not None:
            what += "; " + load_refiner_weights(self.refiner, path)
        self.acc.print(f"weights: {what}")
        return what

    def load_outside_lora(self, spec: str) -> None:
        """A LoRA trained elsewhere as the one active adapter (the config's own is off)."""
        from diffrl.models.lora_files import load_outside_lora

        load_outside_lora(self.adapter.transformer, spec, log=self.acc.print)


def session_for_checkpoint(
    path, config=None, overrides=(), which: str = "evaluated", accelerator=None, **session_kwargs
) -> Session:
    """A :class:`Session` holding the weights of checkpoint ``path``, built from its own
    ``config.yaml`` unless ``config`` names another (with ``overrides`` on top). A named
    config whose model or EMA settings differ from the checkpoint's is said in one line;
    one whose weights do not fit is refused, naming the settings that differ."""
    from diffrl.config import load_config

    path = Path(path)
    if not holds_weights(path):
        raise CheckpointError(
            f"checkpoint '{path}': no trainable.safetensors, pytorch_lora_weights.safetensors or "
            "transformer/ there; pass a run's checkpoints/step-N directory or an export"
        )
    saved = path / "config.yaml"
    if config is None and not saved.is_file():
        raise CheckpointError(f"checkpoint '{path}' has no config.yaml: name its config with --config")
    cfg = load_config(str(config or saved), list(overrides))
    session = Session(cfg, accelerator, **session_kwargs)
    if config is not None:
        note = disagreement(saved, cfg, config)
        if note:
            session.acc.print(note)
    session.load_weights(path, which)
    return session


def disagreement(saved: Path, cfg, name) -> str | None:
    """One line naming the model and EMA settings in which config ``name`` differs from
    the checkpoint's own (``saved``: its config.yaml), or None."""
    diffs = settings_differences(saved, dataclasses.asdict(cfg.model), "model")
    there = saved_ema_decay(saved.parent)
    if there != cfg.train.ema_decay:
        diffs.append(f"train.ema_decay is {there} there and {cfg.train.ema_decay} here")
    if not diffs:
        return None
    shown = "; ".join(diffs[:4]) + (f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else "")
    return f"note: config '{name}' differs from the checkpoint's own config.yaml: {shown}"
