#!/usr/bin/env python
"""Train with online RL: ``accelerate launch scripts/train.py --config NAME [--set k=v] [--dry-run]``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from diffrl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
