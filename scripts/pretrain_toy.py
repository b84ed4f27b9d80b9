#!/usr/bin/env python
"""Pretrain the ShapeWorld toy model with flow matching (see diffrl/toy/pretrain.py).

python scripts/pretrain_toy.py --steps 4000 --out assets/toy_model
"""

from __future__ import annotations

import sys

from diffrl.toy.cli import run_pretraining
from diffrl.toy.pretrain import PretrainConfig, pretrain


def main(argv=None) -> int:
    return run_pretraining(PretrainConfig, pretrain, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
