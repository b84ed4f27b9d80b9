#!/usr/bin/env python
"""Distil the ShapeWorld toy base into a few-step model by reflow (see diffrl/toy/reflow.py).

python scripts/distill_toy.py --threads 2 --out assets/toy_model_fewstep
"""

from __future__ import annotations

import sys

from diffrl.toy.cli import run_pretraining
from diffrl.toy.reflow import ReflowConfig, reflow


def main(argv=None) -> int:
    return run_pretraining(ReflowConfig, reflow, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
