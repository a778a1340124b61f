"""Activation checkpointing's recomputation: it repeats its forward's recipe, or says why not.

Eagerly a recomputation repeats its forward's recipe (:class:`LatestForward`; the
scaling-states feature repeats its scales). A compiled fusible model called inside an
eager ``torch.utils.checkpoint`` is recomputed by its compiled code, which dynamo picks by
the recipe in effect at backward time: where that differs from the forward's, the stage
custom ops say so. They key the forward's choice by the parameters they read (the same
tensors in the recomputation).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fusible.quantization.recipes.autocast import current_key as fp8_recipe_key
from fusible.quantization.recipes.autocast import fp8_recipe

_FORWARD_FP8: dict = {}  # (op class, parameter data_ptr) -> whether its forward ran FP8
_LIMIT = 1 << 16         # stale entries (freed parameters) are dropped past this many
_STATE = {"cleared": False}
_PLAIN = (torch.Tensor, nn.Parameter)


def note_forward(cls, tensors, quantized: bool) -> None:
    """Record (outside a backward pass) or check (inside one: a recomputation) whether a
    compiled forward stage of ``cls`` reading these parameters runs under an FP8 recipe.

    Only FP8 forwards are recorded (a plain one removes its record): no record means a
    forward without FP8, so a process that never ran FP8 pays one test per stage."""
    if not (quantized or _FORWARD_FP8):
        return
    in_backward = torch._C._current_graph_task_id() != -1
    for t in tensors:
        if t is None or t.__class__ not in _PLAIN or not (t.is_leaf and t.requires_grad):
            continue
        key = (cls, t.data_ptr())
        if not in_backward:
            if not quantized:
                _FORWARD_FP8.pop(key, None)
                continue
            if len(_FORWARD_FP8) >= _LIMIT:
                _FORWARD_FP8.clear()
                _STATE["cleared"] = True  # from now on a missing record tells nothing
            _FORWARD_FP8[key] = True
            continue
        recorded = _FORWARD_FP8.get(key)
        if recorded is None and _STATE["cleared"]:
            continue
        if bool(recorded) != quantized:
            raise RuntimeError(
                f"fusible: activation checkpointing recomputes the compiled {cls.__name__} "
                f"stage {'with' if quantized else 'without'} FP8, but its forward ran "
                f"{'without' if quantized else 'with'} it: a compiled model called inside an "
                f"eager torch.utils.checkpoint is recomputed under the fusible.autocast state "
                f"in effect at backward time. Run the backward inside the same "
                f"fusible.autocast block, or compile the checkpointed function instead "
                f"(torch.compile over torch.utils.checkpoint), or run the model eagerly")


def refuse_stateful(cls) -> None:
    """A compiled forward stage that casts with FP8 scaling states (delayed scaling) run
    during a backward pass is activation checkpointing's recomputation by compiled code:
    it would read the states its forward already advanced (other scales, other bits).
    Eagerly the runner replays the forward's scales; compiled code cannot."""
    if torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            f"fusible: activation checkpointing recomputes the compiled {cls.__name__} stage "
            f"under a recipe with scaling states (delayed scaling): compiled code would cast "
            f"with the states its forward already advanced. Checkpoint an eager fusible "
            f"model (its recomputation casts with the forward's scales), or use a recipe "
            f"without state (current scaling) under compiled checkpointing")


_UNSET = object()


class ForwardState:
    """What a recomputation of one forward of a group repeats: its FP8 recipe (``key``,
    ``recipe``) and what the features keep of it in ``snapshots`` (the scaling states'
    copy, from which the recomputation casts)."""

    __slots__ = ("key", "recipe", "snapshots", "generation")

    def __init__(self, key, recipe, generation: int = 0):
        self.key, self.recipe, self.generation = key, recipe, generation
        self.snapshots: dict = {}

    def same_as(self, other: "ForwardState") -> bool:
        """Whether a recomputation of either would compute the same."""
        if self.key != other.key or self.snapshots.keys() != other.snapshots.keys():
            return False
        return all(len(a) == len(b) and all(torch.equal(s, t) for s, t in zip(a, b))
                   for a, b in ((self.snapshots[k], other.snapshots[k])
                                for k in self.snapshots))


class LatestForward:
    """The forward a group's forward run during a backward pass (activation
    checkpointing's recomputation) repeats, as torch.utils.checkpoint restores
    torch.autocast's state: its recipe, decoded once here with its key, and its
    scaling-state snapshot (``current.snapshots``).

    Which forward: inside :func:`fusible.checkpoint_context`'s recomputation, the one its
    own forward kept; else the one checkpointed forward in flight (a forward under
    saved-tensors hooks, or without grad in training mode), or the latest forward. Two or
    more checkpointed forwards in flight that would recompute differently (another recipe,
    other scales) are an error: nothing says which one a recomputation repeats."""

    __slots__ = ("current", "_latest", "_in_flight")

    def __init__(self) -> None:
        self._latest = self.current = ForwardState(_UNSET, None)
        self._in_flight: list = []  # checkpointed forwards not recomputed yet, in order

    @property
    def key(self):
        return self.current.key

    @property
    def recipe(self):
        return self.current.recipe

    def recipe_for_call(self, traced: bool, training: bool = True, name=None) -> tuple:
        """``(key, recipe)`` to run under: the ones in effect, but in a recomputation."""
        if traced or torch._C._current_graph_task_id() == -1:
            self.current = self._forward(fp8_recipe_key(), fp8_recipe(), training, traced)
        elif self._latest.key is not _UNSET:
            self.current = self._recomputed(name)
        return self.current.key, self.current.recipe

    def _forward(self, key, recipe, training: bool, traced: bool) -> ForwardState:
        region = None if traced else _tls.forward_region
        if region is not None:  # fusible.checkpoint_context: this forward's own state
            state = ForwardState(key, recipe)
            region.setdefault(id(self), []).append(state)
        elif not traced and _checkpointed(training):
            state = ForwardState(key, recipe, _steps.count)
            self._in_flight.append(state)
            del self._in_flight[:-_IN_FLIGHT_LIMIT]
            _watch_steps()
        else:  # the latest forward's state, its snapshot's buffers reused
            state = self._latest
            state.key, state.recipe = key, recipe
        self._latest = state
        return state

    def _recomputed(self, name) -> ForwardState:
        region = _tls.recompute_region
        kept = region.get(id(self)) if region is not None else None
        if kept:
            return kept.pop(0)
        flight = [s for s in self._in_flight if s.generation == _steps.count]
        self._in_flight[:] = flight
        if not flight:
            return self._latest
        if len(flight) > 1 and not all(flight[0].same_as(s) for s in flight[1:]):
            raise RuntimeError(
                f"fusible: activation checkpointing recomputes {name() if name else 'a group'} "
                f"while {len(flight)} checkpointed forwards of it are in flight under "
                f"different FP8 recipes or scales (delayed scaling's histories advance each "
                f"forward): torch.utils.checkpoint does not say which forward a "
                f"recomputation repeats. Checkpoint with torch.utils.checkpoint.checkpoint("
                f"..., use_reentrant=False, context_fn=fusible.checkpoint_context) (or "
                f"fusible.checkpoint), which keeps each forward's recipe and scales for its "
                f"own recomputation, or run each forward's backward before the next forward")
        return self._in_flight.pop(0)


_IN_FLIGHT_LIMIT = 64


class _Steps:
    """Optimizer steps taken: the checkpointed forwards of earlier steps are done."""

    count = 0
    hook: Any = None


_steps = _Steps()


class _Regions(threading.local):
    """This thread's fusible.checkpoint_context regions being run (forward, recompute)."""

    forward_region: "dict | None" = None
    recompute_region: "dict | None" = None


_tls = _Regions()


def _checkpointed(training: bool) -> bool:
    """Whether a forward may be recomputed by activation checkpointing: under
    saved-tensors hooks (non-reentrant checkpointing) or, in training mode, without grad
    (reentrant checkpointing's forward)."""
    return (torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            or (training and not torch.is_grad_enabled()))


def _watch_steps() -> None:
    if _steps.hook is None:
        _steps.hook = register_optimizer_step_post_hook(_count_step)


def _count_step(optimizer, args, kwargs) -> None:
    _steps.count += 1


@contextlib.contextmanager
def _entered(attribute: str, region: dict) -> Iterator[None]:
    previous = getattr(_tls, attribute)
    setattr(_tls, attribute, region)
    try:
        yield
    finally:
        setattr(_tls, attribute, previous)


def checkpoint_context() -> tuple:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    each recomputation of the checkpointed function repeats the FP8 recipe and scales of
    its own forward.

    Returns
    -------
    tuple of two context managers
        The forward's (which keeps each fusible group's recipe and scaling-state snapshot
        as it runs) and the recomputation's (which hands them back, in call order).

    Notes
    -----
    Without it a recomputation repeats the latest forward of the group; where two or more
    checkpointed forwards of a group are in flight (pipeline micro-batches, a block called
    twice before the backwards) under different recipes or scales, that is an error.
    """
    region: dict = {}
    return _entered("forward_region", region), _entered("recompute_region", region)


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
    context_fn=fusible.checkpoint_context, **kwargs)``: non-reentrant activation
    checkpointing whose recomputations repeat their own forward's FP8 recipe and scales.

    Parameters
    ----------
    function : callable
        What is checkpointed.
    *args, **kwargs
        Its arguments, and torch.utils.checkpoint's options (``use_reentrant`` and
        ``context_fn`` are set here).

    Returns
    -------
    What ``function`` returns.
    """
    for name in ("use_reentrant", "context_fn"):
        if name in kwargs:
            raise TypeError(f"fusible.checkpoint sets {name} itself (non-reentrant, "
                            f"fusible.checkpoint_context); got {name}={kwargs[name]!r}")
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=checkpoint_context, **kwargs)
