#!/usr/bin/env python
"""Pretrain the ShapeWorld refiner LM, PromptRL's prompt rewriter in miniature
(see diffrl/toy/refiner_pretrain.py and assets/toy_refiner/README.md).

python scripts/pretrain_refiner.py --threads 2 --out assets/toy_refiner
"""

from __future__ import annotations

import sys

from diffrl.toy.cli import run_pretraining
from diffrl.toy.refiner_pretrain import RefinerPretrainConfig, pretrain


def main(argv=None) -> int:
    return run_pretraining(RefinerPretrainConfig, pretrain, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
