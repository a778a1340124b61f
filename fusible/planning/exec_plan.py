"""A group's plan prepared for execution: the core records every plan has.

The core holds what every plan needs: the ops, the stages with their slices of the
group's per-op state, the gradient masks, the saved-record layout and the FP8 hand-off
formats. Everything an execution feature adds (named channels, in-place extra inputs,
``main_grad``, gradient all-reduces, delayed scaling's states, the split backward) is an
optional record in :attr:`ExecPlan.features`, attached by the feature's planning pass
(``planning/features/<feature>.py``) and read by its runtime module
(``runtime/features/<feature>.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import attrs

from fusible.core.conditions import PlanConditions
from fusible.core.context import OperationContext
from fusible.core.results import OpGradNeeds
from fusible.planning.planner import GroupPlan


@attrs.frozen
class ExecStage:
    """A stage with the slices of the group's per-op state it reads and writes.

    ``output_format`` is the ``Float8Format`` in which the stage hands its output
    (forward) or its input gradient (backward) to the next stage; None for a plain
    tensor. ``compute`` is the op's compute classmethod, given that format when the op
    quantizes its own output and the format is a value (a stateful one is bound to its
    state at each call, by the scaling-states feature). In a lane, ``lo`` names the
    stage: feature records key their per-stage data by it.
    """

    op: Any             # the stage's op or fusion
    ops: tuple          # covered basic ops, forward order
    lo: int             # covered ops: [lo, hi) in the group
    hi: int
    extra_in: slice     # extra-input slots of covered ops (one per AddExtraInput input)
    extra_out: slice    # extra-output slots of covered ops
    params: slice       # parameters of covered ops
    compute: Callable[..., Any]  # the op's forward_compute or backward_compute (bound)
    provenance: str     # names the stage in compiled graphs and errors
    grad_mask: tuple = ()  # backward: (input, params, extra inputs) gradients needed
    output_format: Optional[Any] = None
    num_extra_in: int = attrs.field(init=False)
    num_extra_out: int = attrs.field(init=False)
    num_params: int = attrs.field(init=False)

    def __attrs_post_init__(self):  # counts read on the hot path
        for name, span in (("num_extra_in", self.extra_in), ("num_extra_out", self.extra_out),
                           ("num_params", self.params)):
            object.__setattr__(self, name, span.stop - span.start)


@attrs.frozen
class ExecPlan:
    """A :class:`~fusible.planning.planner.GroupPlan` prepared for execution.

    Attributes
    ----------
    group : GroupPlan
        What the planner decided (public stages, candidates, environment).
    ops : tuple
        The group's basic ops.
    forward, backward : tuple of ExecStage
        The stages that run, in execution order (``backward``: only those taking part).
    backward_stages : tuple of Stage
        The public stages of ``backward``.
    needs : tuple of OpGradNeeds
        Per op.
    recipe : Recipe or None
        The FP8 recipe, decoded once for the plan.
    saved_readers : tuple
        Per op: ``(op, who reads its saved record, the record's type, the fields it may
        overwrite in the backward)``.
    num_extra_inputs : int
        Extra inputs the caller passes.
    constant_extra_outputs : tuple of int
        The caller's extra outputs that depend on nothing requiring grad.
    features : Features
        The execution features' records (``fusible.planning.features``).
    op_recipes : tuple
        Per op, the recipe it computes under: ``recipe``, or None for a GEMM the FP8
        policy keeps in high precision (``planning.prepare.gemm_recipes``).
    hooks : object
        Set by the runtime when it takes the plan: the features' runtime hooks bound to
        their records (``fusible.runtime.features``).
    """

    group: GroupPlan
    ops: tuple
    forward: tuple
    backward: tuple
    backward_stages: tuple
    needs: tuple
    recipe: Any
    saved_readers: tuple
    num_extra_inputs: int
    constant_extra_outputs: tuple
    features: Any
    op_recipes: tuple = ()
    hooks: Any = attrs.field(default=None, eq=False)
    validated: dict = attrs.field(factory=dict, eq=False)  # input signatures checked already
    needs_backward: bool = attrs.field(init=False)
    input_needs_grad: bool = attrs.field(init=False)
    num_params: int = attrs.field(init=False)
    idle_ctxs: tuple = attrs.field(init=False)  # contexts for calls that save nothing

    def __attrs_post_init__(self):
        derived = (("needs_backward", any(n.any for n in self.needs)),
                   ("input_needs_grad", self.needs[0].input if self.needs else False),
                   ("num_params", sum(len(op.param_names) for op in self.ops)),
                   ("idle_ctxs", tuple(OperationContext(_idle_needs(op), r)
                                       for op, r in zip(self.ops, self.recipes()))))
        for name, value in derived:
            object.__setattr__(self, name, value)

    @property
    def conditions(self) -> PlanConditions:
        return self.group.env.conditions

    def recipes(self) -> tuple:
        """Per op, the recipe it computes under (``op_recipes``, else ``recipe``)."""
        return self.op_recipes or (self.recipe,) * len(self.ops)

    @property
    def quantized_results(self) -> bool:
        """Whether stage results may be Float8Tensors (an FP8 recipe is in effect)."""
        return self.recipe is not None

    @property
    def outer_dtype(self):
        """Under an FP8 recipe, the dtype Float8Tensors dequantize to; else None."""
        return None if self.recipe is None else self.conditions.dtype


def stage_recipe(stage: ExecStage, op_recipes: tuple, direction: str):
    """The recipe ``stage`` computes ``direction`` under: its ops' (one per op in
    ``op_recipes``; a GEMM the FP8 policy keeps in high precision has None), or None where
    one of its ops that would quantize in ``direction`` is kept so, though another op of
    the stage (a bias, a residual add) computes under the recipe: that GEMM reads the
    stage's input or gradient, and its op computes in high precision (an FP8 hand-off
    would reach it rounded, and a deferral plan made for FP8 would not match its
    compute)."""
    recipe = next((r for r in op_recipes[stage.lo:stage.hi] if r is not None), None)
    if recipe is None:
        return None
    kept = any(r is None and op.quantizes(recipe, direction)
               for op, r in zip(stage.ops, op_recipes[stage.lo:stage.hi]))
    return None if kept else recipe


def _idle_needs(op) -> OpGradNeeds:
    """The needs of an op in a call that saves nothing."""
    return OpGradNeeds(False, (False,) * len(op.param_names), (False,) * op.num_extra_inputs)


@attrs.frozen
class Preparation:
    """What a feature's planning pass reads: the group and its core stages.

    ``backward_public`` holds the planner's public Stage of each entry of ``backward``.
    """

    ops: tuple
    start: int
    conditions: PlanConditions
    recipe: Any
    needs: tuple
    forward: tuple
    backward: tuple
    backward_public: tuple
    op_recipes: tuple = ()
