"""A module call's arguments by name, read against its class's ``forward`` signature (once
per class: a model step binds many calls)."""

from __future__ import annotations

import inspect
from typing import Any, Optional

from torch import nn

_SIGNATURES: dict = {}  # module class -> its forward's signature


def forward_signature(cls: Any) -> inspect.Signature:
    """A module class's forward signature, read once per class."""
    signature = _SIGNATURES.get(cls)
    if signature is None:
        signature = _SIGNATURES[cls] = inspect.signature(cls.forward)
    return signature


def named_arguments(module: nn.Module, args: tuple, kwargs: dict,
                    skip: int = 0) -> Optional[dict]:
    """The call ``module(*args, **kwargs)``'s arguments by name (``**kwargs`` spread out),
    less the first ``skip`` of them; None where the signature does not bind them."""
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


def takes(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward names the argument ``name``."""
    return name in forward_signature(type(module)).parameters


def accepted(module: nn.Module, kwargs: dict) -> dict:
    """The keyword arguments ``module``'s forward takes (all of them with ``**kwargs``)."""
    parameters = forward_signature(type(module)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}
