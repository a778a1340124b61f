"""Plugins advertised in an entry-point group, loaded once: the registries of fusions
(``fusible.fusions``) and of FP8 recipes (``fusible.recipes``) load theirs the same way."""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Callable, Optional


class EntryPointGroup:
    """The plugins of one entry-point group, each a class to ``register`` (or a module whose
    classes registered themselves when imported), loaded at the first :meth:`load`, sorted
    by entry-point name.

    A plugin that fails to load, or that ``register`` refuses (TypeError, ValueError),
    raises a RuntimeError naming it and the group at every :meth:`load` until it loads:
    nothing is skipped silently. ``state`` is ``{"loaded", "loading"}`` (a registration
    during the loading does not load again).
    """

    def __init__(self, group: str, kind: str, register: Callable,
                 before: Optional[Callable] = None):
        self.group, self.kind, self.register, self.before = group, kind, register, before
        self.state = {"loaded": False, "loading": False}

    def load(self) -> None:
        if self.state["loaded"] or self.state["loading"]:
            return
        self.state["loading"] = True
        try:
            if self.before is not None:
                self.before()
            for ep in sorted(importlib.metadata.entry_points(group=self.group),
                             key=lambda e: e.name):
                self._register(ep, self._load(ep))
            self.state["loaded"] = True
        finally:
            self.state["loading"] = False

    def _load(self, ep):
        try:
            return ep.load()
        except Exception as error:
            raise RuntimeError(f"{self.kind} plugin {_describe(ep)} of entry-point group "
                               f"{self.group!r} failed to load: {error}") from error

    def _register(self, ep, loaded) -> None:
        if not inspect.isclass(loaded):
            return
        try:
            self.register(loaded)
        except (TypeError, ValueError) as error:
            raise RuntimeError(f"{self.kind} plugin {_describe(ep)} is not a valid "
                               f"{self.kind}: {error}") from error


def _describe(ep) -> str:
    return f"{ep.name!r} ({getattr(ep, 'value', '?')})"
