#!/usr/bin/env python
"""Evaluate the base model or a run's checkpoint exactly as training does, on any prompts
and seeds: held-out and training-subset scores with standard errors, diversity and
fidelity, printed as one table and written as JSON.

    python scripts/evaluate.py --config toy_flowgrpo --checkpoint base
    python scripts/evaluate.py --config toy_flowgrpo --checkpoint outputs/toy_flowgrpo/checkpoints/step-150 \\
        --set eval.seeds=[101,102] --set data.eval_prompts=my_prompts.txt --json scores.json

A checkpoint is loaded as ``--resume`` loads it, so the EMA weights that the training
evaluations use are the ones scored. Use seeds and prompts the run never saw to re-check
a result independently of the evaluation it was tuned on.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the run's config name or path (or RUN_DIR/config.yaml)")
    p.add_argument("--checkpoint", default="base", help="'base' or a checkpoints/step-N directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", type=Path, default=None, help="write the metrics here")
    args = p.parse_args(argv)

    import tempfile

    from diffrl.config import load_config
    from diffrl.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        quiet = [f"output_dir={tmp}", "logging.trackers=[]", "perf.compile_rollout=false"]
        cfg = load_config(args.config, quiet + list(args.overrides))
        trainer = Trainer(cfg)
        if args.checkpoint != "base":
            trainer.resume(args.checkpoint)
        metrics = trainer.evaluate()
    width = max(len(k) for k in metrics) + 2
    for key in sorted(metrics):
        print(f"{key:<{width}}{metrics[key]:.4g}")
    if args.json:
        args.json.write_text(
            json.dumps({"checkpoint": args.checkpoint, "overrides": args.overrides, **metrics}, indent=1)
        )
    return 0


if __name__ == "__main__":
    from diffrl.cli import run_cli

    run_cli(main)
