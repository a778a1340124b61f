"""Module hooks on fusible operations, as ``torch.nn`` runs them.

An operation (or a nested Sequential) with forward, forward-pre or backward hooks runs as
its own module call inside the pipeline, so that its hooks see the tensors it sees and
their return values take effect; no fusion crosses it. While global module hooks are
registered (``torch.nn.modules.module.register_module_forward_hook`` and friends) every
operation runs so. Registering or removing a hook re-plans.
"""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

from fusible.core import epoch

_LOCAL = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has hooks of its own that a module call runs."""
    d = module.__dict__
    return any(d.get(name) for name in _LOCAL)


def global_hooks_active() -> bool:
    """Whether module hooks are registered for every module (read on every call)."""
    m = _torch_module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks
                or m._global_backward_hooks or m._global_backward_pre_hooks)


class _ReplanningHandle(RemovableHandle):
    """A hook's handle (still a RemovableHandle) that re-plans when the hook goes."""

    _fusible_module: weakref.ref  # set with the class swap (_replanning)

    def remove(self) -> None:
        super().remove()
        module = self._fusible_module()
        if module is not None:
            epoch.bump_if_planned(module)


class ReplanOnHooks:
    """Mixin for modules that take part in plans: hook registration moves the epoch."""

    def _replanning(self, handle):
        epoch.bump_if_planned(self)
        handle.__class__ = _ReplanningHandle
        handle._fusible_module = weakref.ref(self)
        return handle

    def register_forward_hook(self, *args, **kwargs):
        return self._replanning(super().register_forward_hook(*args, **kwargs))

    def register_forward_pre_hook(self, *args, **kwargs):
        return self._replanning(super().register_forward_pre_hook(*args, **kwargs))

    def register_full_backward_hook(self, *args, **kwargs):
        return self._replanning(super().register_full_backward_hook(*args, **kwargs))

    def register_full_backward_pre_hook(self, *args, **kwargs):
        return self._replanning(super().register_full_backward_pre_hook(*args, **kwargs))

    def register_backward_hook(self, *args, **kwargs):
        return self._replanning(super().register_backward_hook(*args, **kwargs))
