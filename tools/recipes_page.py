"""Write docs/RECIPES.md: every recipe config against the reference config it reproduces,
key by key (diffrl.recipes). ``--check`` exits 1 when the page is out of date, or when a
key map is wrong (a difference it does not list, a listed deviation that is none, a
reference key left out)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diffrl.recipes import compare, recipe_names, render

PAGE = Path(__file__).resolve().parent.parent / "docs" / "RECIPES.md"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the page instead of writing it")
    a = parser.parse_args(argv)
    recipes = [compare(name) for name in recipe_names()]
    problems = [p for rc in recipes for p in rc.problems]
    for p in problems:
        print(p, file=sys.stderr)
    text = render(recipes)
    if a.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE} is out of date: python tools/recipes_page.py", file=sys.stderr)
            return 1
        return 1 if problems else 0
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({len(recipes)} recipes)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
