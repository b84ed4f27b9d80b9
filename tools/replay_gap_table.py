"""The replay-gap table of docs/TRAINING.md ("On-policy, measured"): the trainer's own
``replay/logprob_gap`` and ``kl`` before the first optimizer step, for each precision arm
on each path (eager; compiled rollouts with ``perf.exact_replay``; compiled without it),
on the tiny FLUX twin (bf16 weights, no CFG) and the tiny SD3 twin (CFG), one iteration
each under ``train.mixed_precision`` (bf16 unless ``--autocast`` says otherwise), reference
FP8 casts. Each configuration starts from a fresh dynamo cache, as a new process would.

    python tools/replay_gap_table.py [--autocast bf16|fp16] [--twins flux,sd3]

Prints a markdown table (about 5 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch

TWINS = {"flux": ("model.dtype=bfloat16", "model.guidance_scale=1.0"), "sd3": ()}
UNIFIED = ("precision.rollout=fp8", "precision.train=fp8", "precision.backend=reference")
ARMS = {
    "BF16": (),
    "naive split FP8": ("precision.rollout=fp8", "precision.backend=reference"),
    "unified FP8, rowwise": UNIFIED,
    "unified FP8, blockwise": (*UNIFIED, "precision.scaling=blockwise"),
    "unified FP8, tensorwise": (*UNIFIED, "precision.scaling=tensorwise"),
}
PATHS = {
    "eager": ("perf.compile_rollout=false",),
    "compiled, exact_replay": ("perf.compile_rollout=true",),
    "compiled, without it": ("perf.compile_rollout=true", "perf.exact_replay=false"),
}


def measure(twin: str, sets: tuple[str, ...]) -> tuple[float, float]:
    """(replay/logprob_gap, kl) of one iteration of ``tiny_<twin>_flowgrpo`` with ``sets``;
    None where the iteration logged none (a non-finite loss)."""
    from diffrl.config import load_config
    from diffrl.training.trainer import Trainer

    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as out:
        quick = ["train.max_steps=1", "eval.every=0", "checkpoint.every=0", "logging.progress_bar=false"]
        cfg = load_config(f"tiny_{twin}_flowgrpo", [f"output_dir={out}", *quick, *TWINS[twin], *sets])
        with contextlib.redirect_stdout(sys.stderr):  # the runs' own lines, away from the table
            Trainer(cfg).fit()
        row = json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[-1])
    gap, kl = row.get("replay/logprob_gap"), row.get("kl")
    return (None if gap is None else float(gap)), (None if kl is None else float(kl))


def _cell(gap: float | None, kl: float | None) -> str:
    if gap is None or kl is None:  # a non-finite loss skipped the step: nothing was logged
        return "non-finite"
    text = "0" if gap == 0 else f"{gap:.1e}"
    return text if kl == 0 else f"{text} (KL {kl:.0e})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--autocast", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--twins", default="flux,sd3")
    args = parser.parse_args()
    twins = args.twins.split(",")
    header = "| arm | path | " + " | ".join(f"{t} twin" for t in twins) + " |"
    lines = [header, "|" + "---|" * (2 + len(twins))]
    for arm, arm_sets in ARMS.items():
        for path, path_sets in PATHS.items():
            sets = (f"train.mixed_precision={args.autocast}", *arm_sets, *path_sets)
            cells = [_cell(*measure(t, sets)) for t in twins]
            lines.append(f"| {arm} | {path} | " + " | ".join(cells) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
