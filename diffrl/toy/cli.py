"""The command line of the pretraining scripts: one ``--flag`` per field of a config
dataclass, ``--threads``, and bad arguments reported on one line."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch


def run_pretraining(config_class, pretrain, doc: str, argv=None) -> int:
    """Parse ``argv`` into ``config_class``, run ``pretrain(config)``, print where it saved."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    types = {"int": int, "float": float}  # every other field is a string (or None)
    for f in dataclasses.fields(config_class):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=types.get(f.type, str), default=f.default)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (results depend on it)")
    args = vars(parser.parse_args(argv))
    torch.set_num_threads(args.pop("threads"))
    try:
        summary = pretrain(config_class(**args))
    except ValueError as err:  # bad arguments: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"done in {summary['minutes']:.1f} min; saved to {args['out']}")
    return 0
