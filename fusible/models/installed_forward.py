"""InstalledForward: the base of the forwards ``fusible.convert`` installs on a module
instance (a fused decoder layer, a fused expert bank, a model's plain-call mark, a traced
forward with its residual adds fused). Each holds its module by a weak reference (the
module holds the forward: no reference cycle), and a deep copy of the module gets a copy
of the forward that points at the copied module."""

from __future__ import annotations

import copy
import inspect
import weakref

from torch import nn


# The hook functions a module call runs, by the attribute holding them (what a forward
# installed in a module's place would skip where it does not call the module itself)
RUN_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class InstalledForward:
    """Holds the module it is installed on; ``_copied`` names the attributes a deep copy
    copies with the module (the rest are shared, as ``copy.copy`` leaves them)."""

    _copied: tuple = ()

    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)

    @property
    def __signature__(self) -> inspect.Signature:  # the module's (Trainer reads its columns)
        return inspect.signature(type(self._owner()).forward.__get__(self._owner()))

    def _owner(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise ReferenceError(f"the module of this {type(self).__name__} no longer exists")
        return module

    def __deepcopy__(self, memo: dict) -> "InstalledForward":
        new = copy.copy(self)
        new._module = weakref.ref(copy.deepcopy(self._owner(), memo))
        for name in self._copied:
            setattr(new, name, copy.deepcopy(getattr(self, name), memo))
        return new
