"""Base classes of every fusible operation.

Two levels of operation exist. A :class:`BasicOperation` owns its parameters and
state and is what users put in a :class:`~fusible.ops.Sequential`. A
:class:`FusedOperation` owns nothing: the planner builds it over a run of basic
ops and it computes their forward (or backward) in fewer kernels.

Both kinds of *stage* (a basic op or a fused op the plan runs as one step) share
one compute interface, used alike by the eager fuser and, later, by the
registered custom ops:

* ``forward_args(input, params, extra_inputs, ctxs)`` packs an attrs
  ``fwd_args_type`` from the stage input, the covered ops' parameters (flat,
  in op order, each op's ``param_names`` order), the extra inputs they consume
  and their contexts;
* ``forward_compute(args, *, in_custom_op=False)`` (classmethod) returns a
  :class:`ForwardResult`;
* ``save_for_backward(args, result, ctxs)`` stores, per covered basic op, the
  tensors its backward needs, in the layout that basic op documents
  (``saved_fields``), whichever stage produced them;
* ``backward_args(grad_output, grad_extra_outputs, ctxs)`` and
  ``backward_compute(args, *, in_custom_op=False)`` likewise for the backward,
  returning a :class:`BackwardResult`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import attrs
import torch
from torch import nn

from fusible import _epoch, _tokens

Tensor = torch.Tensor


@attrs.define
class ForwardResult:
    """What a forward stage computes.

    Attributes
    ----------
    output : Tensor
        Input of the next stage.
    extra_outputs : tuple of Tensor
        Outputs branched off by covered ``MakeExtraOutput`` ops, in order.
    aux : tuple of Tensor
        Fresh tensors computed only to be saved for backward (e.g. LayerNorm's
        mean and rstd); ``save_for_backward`` picks them up.
    """

    output: Tensor
    extra_outputs: tuple = ()
    aux: tuple = ()


@attrs.define
class BackwardResult:
    """What a backward stage computes.

    Attributes
    ----------
    grad_input : Tensor or None
        Gradient w.r.t. the stage input; None where it is not needed.
    grad_params : tuple of (Tensor or None)
        Gradients of the covered basic ops' parameters, flat, in the order of
        ``fusible_params()`` of each covered op in forward order.
    grad_extra_inputs : tuple of (Tensor or None)
        Gradients of the extra inputs consumed by covered ops, in forward order.
    """

    grad_input: Optional[Tensor]
    grad_params: tuple = ()
    grad_extra_inputs: tuple = ()


@attrs.frozen
class OpGradNeeds:
    """Which gradients one basic op must produce; fixed for a plan.

    Attributes
    ----------
    input : bool
        The gradient w.r.t. the op's input is needed (something upstream
        requires grad).
    params : tuple of bool
        Per parameter in ``fusible_params()`` order.
    extra_inputs : tuple of bool
        Per extra input the op consumes.
    """

    input: bool = False
    params: tuple = ()
    extra_inputs: tuple = ()

    @property
    def any(self) -> bool:
        """Whether this op takes part in the backward pass at all."""
        return self.input or any(self.params) or any(self.extra_inputs)


def pass_through(t: Optional[Tensor], needed: bool, in_custom_op: bool) -> Optional[Tensor]:
    """``t`` itself where needed, else None; a copy inside a custom op, whose outputs
    may not alias its inputs."""
    if not needed:
        return None
    return t.clone() if in_custom_op else t


class OperationContext:
    """Per-call state of one basic op, shared by its forward and backward stages.

    Attributes
    ----------
    needs : OpGradNeeds
        The gradients this op must produce in this call.
    saved : tuple
        Tensors saved for backward, in the layout of the op's ``saved_fields``
        (None where a tensor is not needed). The fuser drops them as soon as
        the backward stage covering the op has run.
    info : Any
        Non-tensor data the backward needs (e.g. an input shape).
    recipe : Float8CurrentScaling or None
        The FP8 recipe the forward ran under (the backward follows it).
    """

    __slots__ = ("needs", "recipe", "saved", "info", "versions")

    def __init__(self, needs: OpGradNeeds, recipe=None):
        self.needs = needs
        self.recipe = recipe
        self.saved: tuple = ()
        self.info: Any = None
        self.versions = ()  # (slot, version) of saved intermediates, set by the fuser

    def clear(self) -> None:
        """Drop the saved tensors: their memory is freed once nothing else holds them."""
        self.saved = ()
        self.info = None
        self.versions = ()


class PlanCachingModule(nn.Module):
    """An ``nn.Module`` that runs as a fusible pipeline (a Sequential, or one op alone)
    and caches its layout with the plans.

    The cache carries the epoch it was built in and is rebuilt when the epoch has
    moved on; ``.to()`` and friends move it on, and pickling leaves the cache out.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _tokens.register(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        _tokens.register(self)

    def _layout(self):
        """The cached :class:`~fusible.layout.Layout`, rebuilt when the epoch moved on."""
        cache = self.__dict__.get("_fusible_cache")
        if cache is None or cache.epoch != _epoch.current():
            cache = self._build_layout()
            object.__setattr__(self, "_fusible_cache", cache)
        return cache

    def _build_layout(self):
        from fusible.layout import Layout, flatten

        return Layout(flatten(self))

    def forward(self, input: Tensor, *extra_inputs: Tensor):
        """Run the pipeline (a lone op: like a one-element Sequential), planned and fused;
        under torch.compile through the stages' custom ops."""
        if torch.compiler.is_compiling():
            from fusible.compiled import compiled_forward

            return compiled_forward(self, input, extra_inputs)
        return self._layout().run_eager(input, extra_inputs)

    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), to_empty() may replace parameter objects behind __setattr__.
        result = super()._apply(fn, recurse)
        _epoch.bump_if_planned(self)
        return result

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_fusible_cache", None)
        return state


# Parallelism settings: set once in a constructor, never changed afterwards.
_CONSTRUCTION_ONLY = frozenset({"tensor_parallel_mode", "sequence_parallel", "tensor_parallel",
                                "tensor_parallel_group", "process_group"})


class FusibleOperation(PlanCachingModule):
    """An operation that can stand in a :class:`~fusible.ops.Sequential`.

    Subclasses are basic ops (:class:`BasicOperation`), fused ops
    (:class:`FusedOperation`) or composites such as :class:`~fusible.ops.Linear`
    that expand into basic ops. Calling one on its own runs it as a one-element
    pipeline.
    """

    fwd_args_type: ClassVar[Optional[type]] = None
    bwd_args_type: ClassVar[Optional[type]] = None
    # Under an FP8 recipe, whether this op's (or fusion's) forward stage takes its input,
    # and its backward stage its incoming gradient, as a Float8Tensor: the stage before
    # it then hands it over already quantized.
    fp8_input_consumer: ClassVar[bool] = False
    fp8_grad_consumer: ClassVar[bool] = False
    # Whether this op's compute takes ``fp8_out``, the ``(fp8_dtype, transposed copy)``
    # format the next stage wants (None: a plain tensor), to fuse the cast into its own
    # kernels. It may return the output (forward) or input gradient (backward) in that
    # format or plain; a plain one is quantized after the compute.
    quantizes_own_output: ClassVar[bool] = False

    def basic_ops(self) -> tuple["BasicOperation", ...]:
        """The basic ops this operation stands for, in forward order."""
        raise NotImplementedError(f"{type(self).__name__} must implement basic_ops()")

    def compile_unsupported_reason(self, direction: str) -> "str | None":
        """Why this op's ``direction`` ("forward" or "backward") stage cannot be compiled.

        None when it can: its args class maps onto a custom-op schema. Override to
        add reasons of your own (call ``super()`` too).
        """
        from fusible import custom_ops

        return custom_ops.unsupported_reason(type(self), direction)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CONSTRUCTION_ONLY and name in self.__dict__:
            raise AttributeError(f"{self.describe()}: {name} is fixed at construction (the "
                                 f"parameter shards and collectives depend on it); build a "
                                 f"new operation instead")
        # Plans depend on op configuration: a new value invalidates cached plans.
        old = self.__dict__.get(name, _epoch._MISSING)
        super().__setattr__(name, value)
        if name != "training" and _epoch.changed(old, value):
            _epoch.bump_if_planned(self)


class BasicOperation(FusibleOperation):
    """An operation that owns its parameters and state.

    Subclasses implement ``validate`` and the compute-interface methods, and
    list the parameters the fuser passes to autograd in ``param_names``.
    ``saved_fields`` documents the layout of ``ctx.saved`` that every stage
    covering the op must fill.
    """

    num_extra_inputs: ClassVar[int] = 0
    num_extra_outputs: ClassVar[int] = 0
    saved_fields: ClassVar[tuple[str, ...]] = ()
    param_names: ClassVar[tuple[str, ...]] = ()

    def basic_ops(self) -> tuple["BasicOperation", ...]:
        return (self,)

    def fusible_params(self) -> list[Tensor]:
        """Parameters that receive gradients through the fuser: ``param_names``, in order."""
        params = self._parameters
        return [params[name] for name in self.param_names]

    def describe(self) -> str:
        """Short label with sizes, used in plans and diagrams."""
        return type(self).__name__

    def diagram_label(self) -> str:
        """Sizes and settings shown under the op's name in plan diagrams."""
        text = self.describe()
        name = type(self).__name__
        return text[len(name) + 1:-1] if text.startswith(name + "(") else ""

    def communication(self, direction: str, needs: "OpGradNeeds | None" = None) -> tuple:
        """The collectives this op's compute runs in ``direction`` ("forward" or
        "backward"), as ``(where, what)`` pairs for plans: ``where`` is "before" or
        "after" the op's own compute, or "is" for a collective op; ``what`` says which
        tensor and how. With ``needs``, only those that run for these gradients. A fusion
        covering an op that communicates must run these itself (``handles_communication``)."""
        return ()

    def grad_reduction(self):
        """The group over which the fuser all-reduces this op's parameter gradients after
        its backward stage (a replicated parameter seeing tokens split over the group,
        ``sequence_parallel=True``), or None."""
        tp = getattr(self, "sequence_parallel_group", None)
        return tp if tp is not None and tp.active else None

    def validate_fp8(self, shape: tuple) -> None:
        """Check an input shape against the op's FP8 constraints (called under a recipe)."""

    def validate(self, shape: tuple, dtype: torch.dtype, device: torch.device,
                 extra_inputs: tuple = ()) -> tuple:
        """Check an input of this shape, dtype and device; return the output shape.

        Raises ValueError or TypeError naming the op and the offending values.
        """
        return tuple(shape)

    # Helpers shared by subclasses -------------------------------------------------

    def _check_param(self, name: str, param: Tensor, dtype: torch.dtype,
                     device: torch.device) -> None:
        if param.dtype != dtype:
            raise TypeError(f"{self.describe()} has {name} of dtype {param.dtype} but got "
                            f"input of dtype {dtype}; convert the model or the input so "
                            f"that they match")
        if param.device != device:
            raise ValueError(f"{self.describe()} has {name} on device {param.device} but got "
                             f"input on device {device}")

    def _check_last_dim(self, shape: tuple, expected: int, what: str) -> None:
        if len(shape) == 0 or shape[-1] != expected:
            got = shape[-1] if len(shape) else "none (a 0-d tensor)"
            raise ValueError(f"{self.describe()} got input with last dimension {got}; "
                             f"expected {what}={expected}")


class FusedOperation(FusibleOperation):
    """Base class of fusions: a stage that covers a run of basic ops and owns nothing.

    A fusion is declared by its class attributes and registered with
    :func:`fusible.register_fusion`:

    ``direction``
        ``"forward"`` or ``"backward"``; the two passes are planned separately.
    ``pattern``
        A :class:`fusible.pattern.Pattern` over basic-op types, written in
        forward (model) order for both directions.
    ``fwd_args_type`` / ``bwd_args_type``
        attrs classes packed by ``forward_args`` / ``backward_args``.

    and, optionally, ``accepts(match, env)`` returning True or the reason for
    refusing a structural match. The planner constructs the fusion with the
    :class:`~fusible.pattern.Match`; ``self.match[name]`` gives a named op.
    """

    direction: ClassVar[str] = ""
    pattern: ClassVar[Any] = None
    # Whether the fusion runs the collectives of the ops it covers (see
    # BasicOperation.communication); the planner refuses it over ops that communicate
    # otherwise.
    handles_communication: ClassVar[bool] = False

    def __init__(self, match):
        super().__init__()
        object.__setattr__(self, "match", match)

    def basic_ops(self) -> tuple[BasicOperation, ...]:
        return self.match.ops

    @classmethod
    def accepts(cls, match, env) -> "bool | str":
        """Return True to accept a structural match, or a string saying why not."""
        return True

    def describe(self) -> str:
        return f"{type(self).__name__}({', '.join(op.describe() for op in self.basic_ops())})"

    def __repr__(self) -> str:
        return self.describe()
