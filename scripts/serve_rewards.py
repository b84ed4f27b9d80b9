"""Serve a registered reward on Ray Serve: the same command as ``diffrl-serve`` (installed
with the package), runnable from a checkout. Options: rewards/serve_cli.py.

    python scripts/serve_rewards.py --reward shapeworld --port 8600
    python scripts/serve_rewards.py --reward 'hpsv21={"checkpoint": "HPS_v2.1_compressed.pt"}' \\
        --replicas 2 --gpus-per-replica 1
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffrl.serve import entry  # noqa: E402 (after the checkout is on the path)

if __name__ == "__main__":
    entry()
