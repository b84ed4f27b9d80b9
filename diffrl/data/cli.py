"""``diffrl-data``: list the field's prompt sets, fetch and verify them, print where they are.

diffrl-data list                      # every set: prompts, source, licence, fetched here or not
diffrl-data fetch geneval/eval        # download and verify (a name, several, or 'all')
diffrl-data fetch pickscore/train pickscore/test --dir /data/prompts
diffrl-data path geneval/eval         # the local file(s), for scripts
"""

from __future__ import annotations

import argparse
import sys

from diffrl.data.registry import SETS, UnknownPromptSet
from diffrl.data.store import PromptSetError, data_dir, fetch, local_files


def _fetched(name: str, root) -> bool:
    try:
        local_files(name, root)
    except PromptSetError:
        return False
    return True


def list_sets(root) -> str:
    lines = [f"prompt sets (data dir {data_dir(root)}):", ""]
    for s in SETS.values():
        count = "?" if s.prompts is None else str(s.prompts)
        state = "fetched" if _fetched(s.name, root) else "not fetched"
        pin = "" if s.pinned else ", not pinnable: first fetch recorded"
        lines.append(f"  {s.name:<28} {count:>6} prompts  {state}{pin}")
        lines.append(f"      {s.source}; {s.licence}")
        if s.used_by:
            lines.append(f"      used by: {s.used_by}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("list", "fetch", "path"))
    p.add_argument("names", nargs="*", help="set names (fetch all: 'all')")
    p.add_argument(
        "--dir", default=None, help="the data folder (default $DIFFRL_DATA or ~/.cache/diffrl/data)"
    )
    a = p.parse_args(argv)
    try:
        if a.command == "list":
            print(list_sets(a.dir))
            return 0
        if not a.names:
            p.error(f"{a.command} needs set names (diffrl-data list shows them)")
        names = list(SETS) if a.names == ["all"] else a.names
        if a.command == "path":
            for name in names:
                print("\n".join(map(str, local_files(name, a.dir))))
            return 0
        return _fetch_each(names, a.dir)
    except (PromptSetError, UnknownPromptSet) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _fetch_each(names: list[str], root) -> int:
    """Fetch every set named, going on past a failure (``fetch all`` stopped at the first);
    each failure is one line, and the last line says which failed. 1 if any did."""
    failed = []
    for name in names:
        try:
            fetch(name, root)
        except (PromptSetError, UnknownPromptSet) as err:
            print(f"error: {err}", file=sys.stderr)
            failed.append(name)
    if failed and len(names) > 1:
        print(f"error: {len(failed)} of {len(names)} sets not fetched: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
