#!/usr/bin/env python
"""Pretrain the ShapeWorld toy model with flow matching (see diffrl/toy/pretrain.py).

python scripts/pretrain_toy.py --steps 4000 --out assets/toy_model
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from diffrl.toy.pretrain import PretrainConfig, pretrain


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    types = {"int": int, "float": float}  # every other field is a string (or None)
    for f in dataclasses.fields(PretrainConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=types.get(f.type, str), default=f.default)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (results depend on it)")
    args = vars(parser.parse_args(argv))
    torch.set_num_threads(args.pop("threads"))
    try:
        summary = pretrain(PretrainConfig(**args))
    except ValueError as err:  # bad arguments: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"done in {summary['minutes']:.1f} min; saved to {args['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
