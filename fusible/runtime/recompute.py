"""Activation checkpointing's recomputation: it repeats its forward's recipe, or says why not.

Eagerly a recomputation repeats its forward's recipe (:class:`LatestForward`; the
scaling-states feature repeats its scales). A compiled fusible model called inside an
eager ``torch.utils.checkpoint`` is recomputed by its compiled code, which dynamo picks by
the recipe in effect at backward time: where that differs from the forward's, the stage
custom ops say so. They key the forward's choice by the parameters they read (the same
tensors in the recomputation).
"""

from __future__ import annotations

import torch
from torch import nn

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


class LatestForward:
    """The FP8 recipe of a group's latest forward, which a forward run during a backward
    pass (activation checkpointing's recomputation) repeats, as torch.utils.checkpoint
    restores torch.autocast's state. The recipe is decoded once here, with its key."""

    __slots__ = ("key", "recipe")

    def __init__(self) -> None:
        self.key: object = _UNSET
        self.recipe = None

    def recipe_for_call(self, traced: bool) -> tuple:
        """``(key, recipe)`` to run under: the ones in effect, but in a recomputation."""
        if traced or torch._C._current_graph_task_id() == -1 or self.key is _UNSET:
            self.key, self.recipe = fp8_recipe_key(), fp8_recipe()
        return self.key, self.recipe
