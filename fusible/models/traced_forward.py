"""The forward of a module rewritten in place by
:func:`fusible.models.residual_adds.fuse_residual_adds`: the code ``torch.fx`` generated
from its trace, installed on the instance so that the module keeps its class, attributes
and methods."""

from __future__ import annotations

import importlib
import types
from typing import Any, Callable

import torch
from torch import nn

from fusible.models.installed_forward import InstalledForward

Tensor = torch.Tensor


class TracedForward(InstalledForward):
    """A module's forward rewritten by :func:`fuse_residual_adds`: the code fx generated
    from its trace, run with the module as ``self`` (its training or evaluation graph,
    where the forward read ``self.training``).

    The graphs hold the plain attributes the forward read as constants: a call after
    one of them changed is an error rather than a silent difference. It refers to its
    module weakly (no reference cycle); deepcopy and pickle carry it to the copy.
    """

    _copied = ("_reads",)

    def __init__(self, module: nn.Module, graphs: dict, reads: dict):
        codes = {mode: g.python_code("self") for mode, g in graphs.items()}
        self._start(module, {mode: (c.src, c.globals) for mode, c in codes.items()}, reads)

    def _start(self, module: nn.Module, sources: dict, reads: dict) -> None:
        super().__init__(module)
        self._sources, self._reads = sources, reads
        self._functions = {mode: _compiled(src, namespace, module)
                           for mode, (src, namespace) in sources.items()}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._owner()
        for name, value in self._reads.items():
            if not _same(getattr(module, name), value):
                raise RuntimeError(
                    f"{type(module).__name__}.{name} changed since fusible.convert traced its "
                    f"forward ({value!r} then), and the rewritten forward holds the old value: "
                    f"convert the model again, or with fuse_residuals=False")
        function = self._functions.get(None) or self._functions[module.training]
        return function(module, *args, **kwargs)

    def __reduce__(self):
        sources = {mode: (src, _picklable_globals(namespace))
                   for mode, (src, namespace) in self._sources.items()}
        return _restored, (self._owner(), sources, self._reads)


def _compiled(src: str, namespace: dict, module: nn.Module) -> Callable:
    code = compile(src, f"<fusible.convert: {type(module).__qualname__}.forward>", "exec",
                   dont_inherit=True)
    namespace = dict(namespace)
    exec(code, namespace)  # the generated ``def forward(self, ...)``
    return namespace["forward"]


def _same(now: Any, then: Any) -> bool:
    if now is then:
        return True
    if isinstance(now, Tensor) or isinstance(then, Tensor):
        return False
    try:
        return type(now) is type(then) and bool(now == then)
    except Exception:  # noqa: BLE001 - a value without a plain ==: compare identities only
        return False


class _ModuleName(str):
    """A Python module in the generated code's globals, pickled by name."""


def _picklable_globals(namespace: dict) -> dict:
    return {k: _ModuleName(v.__name__) if isinstance(v, types.ModuleType) else v
            for k, v in namespace.items() if k != "__builtins__"}


def _restored(module: nn.Module, sources: dict, reads: dict) -> TracedForward:
    """A :class:`TracedForward` unpickled: its code compiled again."""
    sources = {mode: (src, {k: importlib.import_module(v) if isinstance(v, _ModuleName) else v
                            for k, v in namespace.items()})
               for mode, (src, namespace) in sources.items()}
    new = TracedForward.__new__(TracedForward)
    new._start(module, sources, reads)
    return new
