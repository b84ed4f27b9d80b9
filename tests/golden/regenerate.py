"""Rewrite the golden values: ``python -m tests.golden.regenerate [NAME ...]``."""

from __future__ import annotations

import json
import sys

from tests.golden.runs import HERE, RUNS, run


def main(names: list[str]) -> int:
    for name in names or list(RUNS):
        record = run(name)
        (HERE / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {record['steps']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
