"""Command-line entry for training: ``accelerate launch scripts/train.py --config NAME``."""

from __future__ import annotations

import argparse
import sys

from diffrl.config import ConfigError, describe, load_config
from diffrl.training.plan import derive, format_plan
from rewards.errors import UserError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a flow-matching model with online RL (flow-GRPO).")
    p.add_argument("--config", help="config path, or a bare name found in configs/ (e.g. tiny_flux_flowgrpo)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.max_steps=2 (repeatable)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the derived run plan and exit")
    p.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help="with --dry-run (or --tiny-twin): plan for N processes, as `accelerate launch "
        "--num_processes N` would run it (default: the launcher's WORLD_SIZE, else 1)",
    )
    p.add_argument(
        "--preflight",
        action="store_true",
        help="check that every model, reward weight, server and prompt set the run reads is here; "
        "list what is missing, each with its download command, size and licence gate; exit 2 if any",
    )
    p.add_argument("--resume", metavar="latest|PATH", help="continue from the newest checkpoint or a path")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start fresh in an output_dir that holds an earlier run, deleting that run's files",
    )
    p.add_argument("--help-config", action="store_true", help="list every config key with its help text")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--tiny-twin",
        action="store_true",
        help="run the config's algorithm on its family's offline tiny twin (a smoke test; see diffrl.twin)",
    )
    size.add_argument(
        "--full-size",
        action="store_true",
        help="run the config at full size on random weights of its published architecture, with "
        "weight-free reward stand-ins (speed and memory; needs the GPU the config names)",
    )
    args = p.parse_args(argv)
    if not args.help_config and not args.config:
        p.error("--config is required")
    return args


def main(argv=None) -> int:
    import os

    args = parse_args(argv)
    if args.help_config:
        print("\n".join(describe()))
        return 0
    cfg = None
    try:
        cfg = load_config(args.config, args.overrides)
        if args.tiny_twin:
            from diffrl.twin import tiny_twin_overrides

            overrides = tiny_twin_overrides(cfg, _world(args))
            cfg = load_config(args.config, overrides + list(args.overrides))
            if int(os.environ.get("RANK", "0")) == 0:  # said once, however many processes
                print(f"note: --tiny-twin runs with {'; '.join(overrides)} (then your --set)")
        elif args.full_size:
            from diffrl.twin import full_size_overrides

            cfg = load_config(args.config, full_size_overrides(cfg) + list(args.overrides))
        if args.preflight:
            return _preflight_only(cfg)
        _check_inputs(cfg)  # before --overwrite may clear a run: a typo must not cost it
        if args.dry_run:
            print(format_plan(derive(cfg, _world(args))))
            return 0
        _preflight(cfg)  # everything the run reads, before a model is built
        _claim_run_dir(cfg.run_dir, args)
        from diffrl.training.trainer import Trainer

        trainer = Trainer(cfg)
        if args.resume:
            trainer.resume(args.resume)
        trainer.fit()
    except UserError as err:
        say_error(err)
        return 2
    except KeyboardInterrupt:
        print(_interrupted_message(cfg), file=sys.stderr)
        return 130  # the shell's code for SIGINT
    return 0


def _world(args) -> int:
    """The process count a plan is for: ``--num-processes``, else the launcher's WORLD_SIZE
    (set by ``accelerate launch`` and torchrun), else 1. A ``--dry-run`` before an
    8-process launch takes ``--num-processes 8``, so its per-process numbers (optimizer
    steps, trajectory-buffer memory) are the launch's."""
    import os

    if args.num_processes is not None:
        if args.num_processes < 1:
            raise ConfigError(f"--num-processes must be >= 1 (got {args.num_processes})")
        return args.num_processes
    return int(os.environ.get("WORLD_SIZE", "1"))


def _interrupted_message(cfg) -> str:
    """Ctrl-C: no traceback, and whether there is a checkpoint to continue from (one being
    written when the key was pressed is never half-kept: saves are atomic)."""
    from diffrl.inference.checkpoints import latest_complete

    if cfg is None:
        return "interrupted"
    latest = latest_complete(cfg.run_dir)
    if latest is None:
        return f"interrupted: no checkpoint was saved in {cfg.run_dir}; start again with --overwrite"
    step, path = latest
    return (
        f"interrupted: the last checkpoint is {path} (after iteration {step}); continue with "
        f"--resume latest and the same --config and --set"
    )


def _check_inputs(cfg) -> None:
    """What every start, ``--dry-run`` and ``--preflight`` check before touching the run
    directory or loading weights: reward names and argument names, the prompt files, and
    each reward's prompt check on them (a caption GenEval cannot read, a prompt OCR has no
    quoted text in)."""
    from diffrl.data.prompts import (
        PromptFileError,
        check_image_column,
        holdout_split,
        load_prompts,
        prompt_keys,
    )
    from diffrl.models import adapter_class
    from diffrl.models.lora_files import check_lora_spec
    from rewards.combine import check_prompts_without_weights, check_reward_specs

    check_reward_specs(cfg.rewards)
    check_lora_spec(cfg.model.init_lora)
    keys = prompt_keys(cfg)
    loaded, problems = [], []
    for key in keys:  # both files are read before either is reported: one run names both problems
        path = getattr(cfg.data, key)
        try:
            loaded.append((path, load_prompts(path)))
        except UserError as err:  # a bad file, a set not fetched, an unknown set
            problems.append(f"data.{key}: {err}")
    if problems:  # a bad file fails before models import
        raise PromptFileError("\n".join(problems))
    if cfg.data.eval_holdout:  # enough prompts left to train on, checked before models load
        holdout_split(loaded[0][1], cfg.data.eval_holdout, loaded[0][0])
    edits = adapter_class(cfg.model.family).edits_images
    for path, prompts in loaded:
        check_image_column(prompts, path, cfg.model.family, edits)
        check_prompts_without_weights(cfg.rewards, prompts, str(path))


def _preflight_only(cfg) -> int:
    """``--preflight``: the whole list (the main process prints it); 2 if anything is missing."""
    import os

    from diffrl.inference.preflight import preflight, report

    needs = preflight(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(report(needs))
    if not all(n.found for n in needs if n.what.startswith(("prompt set", "prompt file"))):
        return 2  # the prompts cannot be read yet: the list says what to fetch first
    _check_inputs(cfg)  # the prompts, and what each reward can score of them
    return 0 if all(n.found for n in needs) else 2


def _preflight(cfg) -> None:
    """The start's preflight (:func:`~diffrl.inference.preflight.stop_if_missing`)."""
    from diffrl.inference.preflight import stop_if_missing

    stop_if_missing(cfg, "diffrl-train --preflight checks again without starting")


def _claim_run_dir(run_dir, args) -> None:
    """Before any model is loaded: refuse a fresh run into a used directory (one error that
    offers the ways on), or, with --overwrite, clear it on the main process."""
    import os

    from diffrl.training import run_dir as guard

    if args.overwrite and args.resume:
        raise ConfigError("--overwrite starts over and --resume continues: pass one of them")
    if args.resume:
        return
    if not args.overwrite:
        guard.ensure_fresh(run_dir)
    elif int(os.environ.get("RANK", "0")) == 0:
        removed = guard.clear(run_dir)
        if removed:
            print(f"--overwrite: deleted {', '.join(removed)} from {run_dir}")


def say_error(err: BaseException) -> None:
    """One ``error:`` line, from the main process only: a bad input is the same on every
    process of a launch, and N copies of it (plus their launchers' blocks) bury it. A
    single process (no ``RANK``) always says it."""
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {err}", file=sys.stderr, flush=True)


def run_cli(fn, argv=None) -> None:
    """Run a script's ``main``; bad input ends with one ``error:`` line and exit code 2."""
    try:
        fn(argv)
    except UserError as err:
        say_error(err)
        raise SystemExit(2) from None
