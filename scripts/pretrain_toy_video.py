#!/usr/bin/env python
"""Pretrain the ShapeWorld toy video model (a Wan-class DiT) with flow matching on clips
of objects that move as their captions say (see diffrl/toy/pretrain_video.py).

The defaults are the shipped recipe (the capable base, ~30 min on 2 cores); the RL base
continues it with caption noise (assets/toy_video_model/README.md):

python scripts/pretrain_toy_video.py --threads 1 --out assets/toy_video_model_capable
python scripts/pretrain_toy_video.py --threads 1 --init assets/toy_video_model_capable --seed 1 --steps 1500 \
    --curriculum 1,0,0 --caption-noise 0.3 --out assets/toy_video_model
"""

from __future__ import annotations

import sys

from diffrl.toy.cli import run_pretraining
from diffrl.toy.pretrain_video import VideoPretrainConfig, pretrain_video


def main(argv=None) -> int:
    return run_pretraining(VideoPretrainConfig, pretrain_video, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
