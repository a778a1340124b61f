"""What a fusible group refuses to run under, with a clear error: torch.func transforms,
forward-mode AD and torch.jit.trace (a group is one autograd.Function whose planning is
Python and whose stages are custom ops)."""

from __future__ import annotations

import torch
from torch.autograd import forward_ad


def transforms_active() -> bool:
    """Whether a transform a group may refuse is active (the runner reads the same three
    flags inline on every eager call, and calls :func:`refuse_transforms` when one is set)."""
    return (torch._C._are_functorch_transforms_active() or torch._C._is_tracing()
            or forward_ad._current_level >= 0)


def refuse_transforms(runner, x) -> None:
    """Raise, naming the group, under a transform the group cannot run under."""
    if not transforms_active():
        return
    name = runner.name()
    if torch._C._is_tracing():
        raise RuntimeError(f"fusible: torch.jit.trace cannot record {name} (its planning is "
                           f"Python and its stages custom ops): use torch.compile, or "
                           f"torch.export")
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"fusible: {name} cannot run under torch.func transforms (grad, "
                           f"vmap, jacrev, jvp, ...): a pipeline is one autograd.Function "
                           f"without vmap or forward-mode rules; take gradients with "
                           f"torch.autograd (see docs/guide.md, Limits)")
    if forward_ad.unpack_dual(x).tangent is not None or any(
            forward_ad.unpack_dual(p).tangent is not None for p in runner.params.read()):
        raise RuntimeError(f"fusible: {name} has no forward-mode AD (dual tensors): take "
                           f"gradients with torch.autograd's reverse mode")
