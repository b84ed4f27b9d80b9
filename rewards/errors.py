"""Other libraries' exceptions as one self-contained line inside our own error messages.

Hub and loader errors are written for a reader who sees the traceback: they span lines
and point at "the stacktrace above". Our errors are printed without a traceback, so the
root cause is folded in instead and such pointers are dropped. (Lives in ``rewards`` so
that both ``rewards`` and ``diffrl`` can use it without a circular import.)
"""

from __future__ import annotations

import re


class UserError(Exception):
    """Bad input from the user (a config key, a path, a checkpoint, a reward's arguments):
    every entry point prints it as one ``error:`` line, once however many processes run,
    and never as a traceback. Each such error type of ``rewards`` and ``diffrl`` derives
    from it, so the entry points catch this one class instead of keeping a list."""


# sentences that point at output the user does not see once the error is one line
_POINTERS = re.compile(r"[^.]*\b(stack ?trace|traceback)\b[^.]*(above|below)[^.]*\.?", re.IGNORECASE)
MAX_CHARS = 400


def one_line(err: BaseException, max_chars: int = MAX_CHARS) -> str:
    """``Type: message`` of ``err`` on one line, followed by its root cause (the chained
    exception a "see above" would have pointed at), each shortened to ``max_chars``."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen and len(parts) < 3:
        seen.add(id(err))
        text = " ".join(_POINTERS.sub("", str(err)).split()).rstrip(" .:")
        if len(text) > max_chars:
            text = text[: max_chars - 3] + "..."
        parts.append(f"{type(err).__name__}: {text}" if text else type(err).__name__)
        err = err.__cause__ or err.__context__
    return "; caused by ".join(parts)


def some_of(items, limit: int = 5) -> str:
    """The first ``limit`` items quoted, then how many more: for errors that list bad prompts."""
    shown = "; ".join(repr(str(i)) for i in items[:limit])
    return shown + (f" (and {len(items) - limit} more)" if len(items) > limit else "")
