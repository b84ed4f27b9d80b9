#!/usr/bin/env python
"""Evaluate the base model or a run's checkpoint exactly as training does, on any prompts
and seeds: held-out and training-subset scores with standard errors, diversity and
fidelity, printed as one table and written as JSON.

    python scripts/evaluate.py --config toy_flowgrpo --checkpoint base
    python scripts/evaluate.py --checkpoint outputs/toy_flowgrpo/checkpoints/step-150 \\
        --set eval.seeds=[101,102] --set data.eval_prompts=my_prompts.txt --json scores.json

A checkpoint's weights are those its evaluations scored (its EMA where the run kept one;
``--weights trained`` or ``ema`` picks), read without its optimizer or RNG state, under
the checkpoint's own config.yaml unless ``--config`` names another (a config that
differs from it is named in one line). Use seeds and prompts the run never saw to
re-check a result independently of the evaluation it was tuned on.

The papers' protocols (diffrl.evaluation.protocols; their prompt sets fetched first with
``diffrl-data fetch``), one markdown table and one JSON in ``--out``:

    python scripts/evaluate.py --protocol geneval --config sd35_flowgrpo --lora jieliu/SD3.5M-FlowGRPO-GenEval
    python scripts/evaluate.py --protocol ocr --config sd35_flowgrpo --checkpoint RUN/checkpoints/step-500 \\
        --reward-arg ocr.engine=paddleocr
    python scripts/evaluate.py --protocol drawbench --config sd35_diffusionnft \\
        --reward-arg hpsv21.checkpoint=/w/HPS_v2.1_compressed.pt \\
        --reward-arg imagereward.checkpoint=/w/ImageReward.pt \\
        --reward-arg unifiedreward.base_url=http://127.0.0.1:17140/v1
    accelerate launch --num_processes 8 scripts/evaluate.py --protocol hpdv2 --config flux_flowgrpo ...

Protocols: geneval (553 prompts x 4 images, GenEval's summary), geneval_test (flow_grpo's
2,212-line test split x 1, DiffusionNFT's GenEval column), ocr (flow_grpo's OCR test
accuracy, PaddleOCR), drawbench (200 prompts x 5) and pickscore (PickScore's 2,048 test
prompts x 1) in DiffusionNFT's six columns and scales, hpdv2 (HPSv2's benchmark: reward
means with standard errors, per style), shapeworld. docs/COMPARE.md pairs each paper's
reported column with its command. Every image is saved under OUT/<protocol>_images in
GenEval's layout (--no-images skips). Several processes shard the prompts and write the
table one process writes.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config",
        help="the config name or path; with --checkpoint, default: the checkpoint's own config.yaml",
    )
    p.add_argument("--checkpoint", default="base", help="'base' or a checkpoints/step-N directory")
    p.add_argument(
        "--weights",
        choices=("evaluated", "trained", "ema"),
        default="evaluated",
        help="a checkpoint's weights: those its evaluations scored (the EMA where the run kept one; "
        "default), the trained ones, or the EMA",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", type=Path, default=None, help="write the metrics here")
    _protocol_args(p)
    args = p.parse_args(argv)
    if args.checkpoint == "base" and not args.config:
        p.error("--config is required with --checkpoint base")
    if args.protocol:
        from diffrl.evaluation.protocol_run import run

        run(_protocol_request(args))
        return 0

    from diffrl.evaluation.scoring import evaluate_run

    metrics = evaluate_run(_session(args))
    width = max(len(k) for k in metrics) + 2
    for key in sorted(metrics):
        print(f"{key:<{width}}{metrics[key]:.4g}")
    if args.json:
        from diffrl.evaluation import json_out  # NaN scores as null: strict parsers read it

        args.json.write_text(
            json_out.dumps({"checkpoint": args.checkpoint, "overrides": args.overrides, **metrics}, indent=1)
        )
    return 0


def _session(args):
    """The inference session of the config, or of the checkpoint (its own config unless
    --config names one): no optimizer, no RNG state, no training run."""
    from diffrl.inference.session import Session, session_for_checkpoint

    if args.checkpoint == "base":
        from diffrl.config import load_config

        return Session(load_config(args.config, args.overrides), prompts=("eval",))
    return session_for_checkpoint(
        args.checkpoint, args.config, args.overrides, args.weights, prompts=("eval",)
    )


def _protocol_request(args):
    from diffrl.evaluation.protocol_run import ProtocolRun

    return ProtocolRun(
        protocol=args.protocol,
        config=args.config,
        overrides=tuple(args.overrides),
        checkpoint=args.checkpoint,
        weights=args.weights,
        lora=args.lora,
        prompts=args.prompts,
        paraphrases=args.paraphrases,
        limit=args.limit,
        images=args.images,
        rewards=tuple(args.rewards.split(",")) if args.rewards else (),
        reward_args=tuple(args.reward_args),
        out=args.out,
        save_images=not args.no_images,
    )


def _protocol_args(p: argparse.ArgumentParser) -> None:
    from diffrl.evaluation.protocols import PROTOCOLS

    p.add_argument("--protocol", choices=sorted(PROTOCOLS), help="run a paper's evaluation protocol")
    p.add_argument("--lora", help="a LoRA from elsewhere: a PEFT or diffusers folder, a file or a hub id")
    p.add_argument("--prompts", help="another prompt set or file than the protocol's")
    p.add_argument(
        "--paraphrases",
        help="a paraphrase file (.jsonl: prompt, original; docs/DATA.md): its originals and its paraphrases "
        "from the same noise, both judged against the originals, and the gap",
    )
    p.add_argument("--limit", type=int, default=0, help="the first N prompts only (a quick look)")
    p.add_argument("--images", type=int, default=0, help="images per prompt (default: the protocol's)")
    p.add_argument("--rewards", help="comma list: a subset of the protocol's rewards")
    p.add_argument("--reward-arg", dest="reward_args", action="append", default=[], metavar="NAME.KEY=VALUE")
    p.add_argument("--out", default="outputs/eval", help="where the table, the JSON and the images go")
    p.add_argument("--no-images", action="store_true", help="do not save the protocol's images")


if __name__ == "__main__":
    from diffrl.cli import run_cli

    run_cli(main)
