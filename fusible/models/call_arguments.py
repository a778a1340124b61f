"""A module call's arguments by name, read against its class's ``forward`` signature (once
per class: a model step binds many calls). Plain signatures bind without ``inspect`` (which
dynamo cannot trace: a compiled model would break its graph at every layer called with
positional arguments)."""

from __future__ import annotations

import inspect
from typing import Any, Optional

from torch import nn

_SIGNATURES: dict = {}  # module class -> its forward's signature
_LAYOUTS: dict = {}  # module class -> (positional names after self, keyword names, **kwargs?)
_NAMES: dict = {}  # module class -> (its forward's parameter names, takes **kwargs?)


def forward_signature(cls: Any) -> inspect.Signature:
    """A module class's forward signature, read once per class."""
    signature = _SIGNATURES.get(cls)
    if signature is None:
        signature = _SIGNATURES[cls] = inspect.signature(cls.forward)
    return signature


def _layout(cls: Any) -> Optional[tuple]:
    """``(positional names, all names, takes **kwargs, required names)`` of a forward
    without ``*args`` or positional-only parameters (after ``self``), else None."""
    if cls not in _LAYOUTS:
        params = list(forward_signature(cls).parameters.values())[1:]
        kinds = {p.kind for p in params}
        plain = not kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY}
        positional = tuple(p.name for p in params
                           if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
        required = tuple(p.name for p in params if p.default is inspect.Parameter.empty
                         and p.kind is not inspect.Parameter.VAR_KEYWORD)
        _LAYOUTS[cls] = (positional, names, inspect.Parameter.VAR_KEYWORD in kinds, required) \
            if plain else None
    return _LAYOUTS[cls]


def read_ahead(cls: Any) -> None:
    """Read ``cls``'s forward signature now, for the calls to bind later: under
    ``torch.compile`` a first read would be traced (dynamo 2.11 breaks the graph at the
    signature's parameter mapping). The forwards ``convert`` installs call it."""
    _layout(cls)
    _names(cls)


def named_arguments(module: nn.Module, args: tuple, kwargs: dict,
                    skip: int = 0) -> Optional[dict]:
    """The call ``module(*args, **kwargs)``'s arguments by name (``**kwargs`` spread out),
    less the first ``skip`` of them; None where the signature does not bind them."""
    layout = _layout(type(module))
    if layout is not None:
        positional, names, var_keyword, required = layout
        if len(args) > len(positional):
            return None
        named = dict(zip(positional, args))
        for name, value in kwargs.items():
            if name in named or (name not in names and not var_keyword):
                return None
            named[name] = value
        if not all(name in named for name in required):  # (dynamo 2.11 compares no sets)
            return None
        for name in positional[:skip]:
            named.pop(name, None)
        return named
    signature = forward_signature(type(module))
    try:
        bound = signature.bind(module, *args, **kwargs)
    except TypeError:
        return None
    named = dict(bound.arguments)
    for name in list(named)[:1 + skip]:  # self, then the skipped ones
        named.pop(name)
    for name, value in list(named.items()):
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.pop(name)
            named.update(value)
    return named


def _names(cls: Any) -> tuple:
    """``(parameter names, takes **kwargs)`` of a module class's forward, as plain data
    (dynamo 2.11 breaks the graph reading a signature's parameter mapping)."""
    if cls not in _NAMES:
        parameters = forward_signature(cls).parameters.values()
        _NAMES[cls] = (frozenset(p.name for p in parameters),
                       any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters))
    return _NAMES[cls]


def takes(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward names the argument ``name``."""
    return name in _names(type(module))[0]


def accepted(module: nn.Module, kwargs: dict) -> dict:
    """The keyword arguments ``module``'s forward takes (all of them with ``**kwargs``)."""
    names, var_keyword = _names(type(module))
    if var_keyword:
        return kwargs
    return {k: v for k, v in kwargs.items() if k in names}
