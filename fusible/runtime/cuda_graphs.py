"""Whole-step CUDA graphs for eager users: ``torch.cuda.make_graphed_callables`` with the
conditions a fusible plan depends on pinned at capture.

A captured graph replays the kernels of one plan: the FP8 recipe, the input shapes,
dtypes and which inputs require grad are baked into it. PyTorch's helper checks none of
these (a smaller batch is even broadcast into the captured input buffer); this one
refuses a call that differs, naming what changed, instead of replaying the wrong plan.
Everything else is PyTorch's: the module's ``forward`` is replaced, a module switched to
the other training mode runs its ordinary forward, parameters are read in place (an
optimizer's in-place updates are seen; reassigned parameters are not).
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from fusible.core.lanes import splitting
from fusible.quantization.recipes.autocast import current_key


@attrs.frozen
class _Captured:
    """What the graph was captured under."""

    recipe_key: object
    inputs: tuple  # (shape, dtype, device, requires_grad) per sample argument

    def check(self, name: str, args: tuple) -> None:
        key = current_key()
        if key != self.recipe_key:
            raise RuntimeError(
                f"{name}: captured {_recipe_words(self.recipe_key)}, called "
                f"{_recipe_words(key)}: the graph replays the captured plan; call it under "
                f"the same fusible.autocast state, or capture another graph")
        if len(args) != len(self.inputs):
            raise TypeError(f"{name}: captured with {len(self.inputs)} argument(s), called with "
                            f"{len(args)}")
        for i, (arg, want) in enumerate(zip(args, self.inputs)):
            got = _describe(arg)
            if got != want:
                raise ValueError(
                    f"{name}: argument {i} is (shape, dtype, device, requires_grad) {got}; the "
                    f"graph was captured for {want} (CUDA graphs replay fixed shapes)")


def _describe(t) -> tuple:
    if not isinstance(t, torch.Tensor):
        return (type(t).__name__,)
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _recipe_words(key) -> str:
    return "without FP8" if key is None else f"under the FP8 recipe {key}"


def _split_refused(name: str) -> RuntimeError:
    return RuntimeError(f"{name}: a split backward (fusible.split_backward) queues its "
                        f"deferred weight gradients in Python, which a CUDA graph does not "
                        f"replay; capture and run it outside split_backward()")


def make_graphed_callables(module: nn.Module, sample_args: tuple, *,
                           num_warmup_iters: int = 3) -> nn.Module:
    """Capture ``module``'s forward and backward as CUDA graphs, for eager training steps
    without host overhead.

    Parameters
    ----------
    module : nn.Module
        A fusible Sequential (or a module of them) on a CUDA device, without hooks, in
        the training mode the graphs are for.
    sample_args : tuple of Tensor
        Arguments with the shapes, dtypes and ``requires_grad`` of every later call.
    num_warmup_iters : int
        Eager iterations before capture (Triton compiles and plans are cached there).

    Returns
    -------
    nn.Module
        ``module`` itself, its ``forward`` replaced by the graphed one (as
        ``torch.cuda.make_graphed_callables`` does). Call it under the
        ``fusible.autocast`` state of the capture: another state, or arguments of
        another shape, dtype, device or ``requires_grad``, raise.

    Raises
    ------
    ValueError
        If an argument is not a CUDA tensor.
    """
    name = f"fusible.make_graphed_callables({type(module).__name__})"
    sample_args = tuple(sample_args)
    if not sample_args or not all(isinstance(a, torch.Tensor) and a.is_cuda
                                  for a in sample_args):
        raise ValueError(f"{name}: CUDA graphs need CUDA tensor arguments, got "
                         f"{[_describe(a) for a in sample_args]}")
    if splitting():
        raise _split_refused(name)
    captured = _Captured(current_key(), tuple(_describe(a) for a in sample_args))
    training = module.training
    torch.cuda.make_graphed_callables(module, sample_args, num_warmup_iters=num_warmup_iters)
    graphed_forward = module.forward

    def forward(*args):
        if module.training == training:  # else PyTorch runs the ordinary forward
            captured.check(name, args)
            if splitting():
                raise _split_refused(name)
        return graphed_forward(*args)

    module.forward = forward
    return module
