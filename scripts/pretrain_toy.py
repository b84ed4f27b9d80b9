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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(PretrainConfig):
        kind = str if f.type in ("str | None", "str") else eval(f.type)  # noqa: S307 (fixed dataclass types)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (results depend on it)")
    args = vars(parser.parse_args(argv))
    torch.set_num_threads(args.pop("threads"))
    summary = pretrain(PretrainConfig(**args))
    print(f"done in {summary['minutes']:.1f} min; saved to {args['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
