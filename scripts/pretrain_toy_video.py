#!/usr/bin/env python
"""Pretrain the ShapeWorld toy video model (a Wan-class DiT) with flow matching on clips
of objects that move as their captions say (see diffrl/toy/pretrain_video.py).

python scripts/pretrain_toy_video.py --steps 3000 --caption-noise 0.5 --out assets/toy_video_model
"""

from __future__ import annotations

import sys

from diffrl.toy.cli import run_pretraining
from diffrl.toy.pretrain_video import VideoPretrainConfig, pretrain_video


def main(argv=None) -> int:
    return run_pretraining(VideoPretrainConfig, pretrain_video, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
