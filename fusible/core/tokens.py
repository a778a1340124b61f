"""Integer tokens for Python objects that a compiled graph refers to.

A compiled graph can carry only constants, so fusible modules and runners are
named by their ``id`` and looked up here (weakly: the registry keeps nothing alive).
"""

import weakref

_objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register(obj) -> int:
    """Make ``obj`` reachable by its token; returns the token."""
    _objects[id(obj)] = obj
    return id(obj)


def lookup(token: int):
    """The object registered under ``token``."""
    obj = _objects.get(token)
    if obj is None:
        raise RuntimeError(f"fusible: no live object for token {token}; was the module "
                           f"deleted while a compiled graph still refers to it?")
    return obj
