"""One registry helper for every registry of the project: rewards (``rewards``), model
families (``diffrl.models``), rollout strategies (``diffrl.sampling``) and objectives
(``diffrl.algorithms``). It lives in ``rewards``, the package that imports nothing from
``diffrl``, so that both can use it.

A target is the object itself or a lazy ``"package.module:attr"`` string imported on
first use, so registering never imports heavy code (or touches the network). An unknown
name raises one error that suggests the closest registered name and lists them all.
"""

from __future__ import annotations

import difflib
import importlib


class Registry:
    def __init__(
        self,
        kind: str,
        entries: dict | None = None,
        error: type[Exception] = ValueError,
        plural: str | None = None,
    ):
        self.kind, self.error = kind, error
        self.plural = plural or f"{kind}s"
        self._entries: dict = dict(entries or {})

    def register(self, name: str, target) -> None:
        self._entries[name] = target

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def available(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def unknown(self, name: str) -> Exception:
        """The error for an unregistered ``name``: a "did you mean" and every valid name."""
        close = difflib.get_close_matches(name, self.available(), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return self.error(
            f"unknown {self.kind} '{name}'.{hint} Valid {self.plural}: {', '.join(self.available())}"
        )

    def get(self, name: str):
        if name not in self._entries:
            raise self.unknown(name)
        target = self._entries[name]
        if isinstance(target, str):
            module, attr = target.split(":")
            target = getattr(importlib.import_module(module), attr)
        return target
