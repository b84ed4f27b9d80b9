"""The reward-service command: ``diffrl-serve --reward NAME`` (installed with the package),
``python -m diffrl.serve`` or ``scripts/serve_rewards.py``; all three run
:func:`rewards.serve_cli.main` (Ray Serve, the `serve` extra), with bad input ending in one
``error:`` line."""

from diffrl.cli import run_cli
from rewards.serve_cli import main


def entry() -> None:
    run_cli(main)


if __name__ == "__main__":
    entry()
