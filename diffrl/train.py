"""The training command: ``diffrl-train --config NAME`` (installed with the package),
``python -m diffrl.train`` or ``scripts/train.py``; all three run :func:`diffrl.cli.main`.

One process needs no launcher. Several (GPUs, or CPU processes) go through accelerate:
``accelerate launch -q --num_processes N -m diffrl.train --config NAME`` (``-q`` keeps
accelerate from adding its own traceback under our one-line errors).
"""

import sys

from diffrl.cli import main


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
