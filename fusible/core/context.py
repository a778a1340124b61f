"""OperationContext: the per-call state one basic op shares between its two stages."""

from __future__ import annotations

from typing import Any

from fusible.core.results import OpGradNeeds


class OperationContext:
    """Per-call state of one basic op, shared by its forward and backward stages.

    Attributes
    ----------
    needs : OpGradNeeds
        The gradients this op must produce in this call.
    recipe : object or None
        The FP8 recipe the forward ran under (the backward follows it).
    saved : attrs record or None
        What the op's backward needs: an instance of the op's ``saved_type``, set by
        whichever forward stage covered the op (None: nothing saved). The fuser drops it
        as soon as the backward stage covering the op has run.
    states : dict
        Under a recipe with stateful formats (delayed scaling), the op's state tensor of
        each of its ``scaling_state_roles`` (role -> Tensor), set by the fuser for the
        call; empty otherwise.
    """

    __slots__ = ("needs", "recipe", "saved", "versions", "outputs", "owned", "states")

    def __init__(self, needs: OpGradNeeds, recipe: Any = None):
        self.needs = needs
        self.recipe = recipe
        self.states: dict = {}
        self.saved: Any = None
        self.versions = ()  # (field, version) of saved intermediates, set by the fuser
        self.outputs = ()   # fields holding outputs kept by autograd, set by the fuser
        # fields of the reader's consumable_saved whose tensor only this record holds (the
        # backward may write over it), set by the fuser
        self.owned = ()

    def clear(self) -> None:
        """Drop the saved record: its tensors are freed once nothing else holds them."""
        self.saved = None
        self.versions = self.outputs = ()
