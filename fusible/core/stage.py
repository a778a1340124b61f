"""The compute interface every stage declares: a basic op, or a fusion over a run of them.

A stage packs its arguments into an attrs record (``forward_args`` /
``backward_args``, instance methods that may read configuration, parameters and
contexts), computes from that record alone (``forward_compute`` /
``backward_compute``, classmethods: the same code runs eagerly and as the kernel of
the stage's custom op under ``torch.compile``) and stores what its backward needs
(``save_for_backward``). The hooks below are the contract; the classes that use them
(:class:`~fusible.core.operation.BasicOperationSpec` at class creation,
:func:`fusible.register_fusion` at registration) check that they are defined.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Optional

import attrs

from fusible.core.results import BackwardResult, ForwardResult

HOOKS = {
    "forward": ("forward_args", "forward_compute", "save_for_backward"),
    "backward": ("backward_args", "backward_compute"),
}
ARGS_TYPES = {"forward": "fwd_args_type", "backward": "bwd_args_type"}
FORMAT_HOOKS = {"forward": "input_format", "backward": "grad_format"}


class StageSpec:
    """The hooks of a stage's compute interface (see the module docstring).

    Class attributes
    ----------------
    fwd_args_type, bwd_args_type : attrs class
        The records ``forward_args`` / ``backward_args`` return. Their field
        annotations are the stage's custom-op schema (``fusible.core.schema``).
    quantizes_own_output : bool
        The compute methods take ``output_format`` (a ``Float8Format`` or None: the
        format the next stage wants its input, or the previous stage its gradient, in)
        and may return that output already quantized, fusing the cast into their own
        kernels; a plain output is quantized after the compute.
    """

    fwd_args_type: ClassVar[Optional[type]] = None
    bwd_args_type: ClassVar[Optional[type]] = None
    quantizes_own_output: ClassVar[bool] = False

    def basic_ops(self) -> tuple:
        """The basic ops this stage covers, in forward order."""
        raise NotImplementedError(f"{type(self).__name__} must define basic_ops()")

    def describe(self) -> str:
        """A short label with sizes, for plans, diagrams and error messages."""
        return type(self).__name__

    def forward_args(self, input, params: tuple, extra_inputs: tuple, ctxs: tuple) -> Any:
        """Pack the forward stage's arguments.

        Parameters
        ----------
        input : Tensor or Float8Tensor
            The stage input (a Float8Tensor only where ``input_format`` asked for one).
        params : tuple of Tensor
            The covered ops' parameters, flat, in op order and each op's
            ``param_names`` order: the tensors autograd sees for this call.
        extra_inputs : tuple of Tensor
            The extra inputs the covered ``AddExtraInput`` ops consume, in order.
        ctxs : tuple of OperationContext
            One per covered op: ``needs`` (the gradients to produce) and ``recipe``.

        Returns
        -------
        fwd_args_type
        """
        raise NotImplementedError(f"{type(self).__name__} must define forward_args()")

    @classmethod
    def forward_compute(cls, args, *, in_custom_op: bool = False) -> ForwardResult:
        """Compute the forward from ``args`` alone.

        Parameters
        ----------
        args : fwd_args_type
        in_custom_op : bool
            True when this runs as the kernel of the stage's custom op (compiled): then
            eager-only side effects (freeing storage, bookkeeping on parameters) must
            not run. Outputs may alias inputs: the custom-op boundary copies those.

        Returns
        -------
        ForwardResult
        """
        raise NotImplementedError(f"{cls.__name__} must define forward_compute()")

    def save_for_backward(self, args, result: ForwardResult, ctxs: tuple) -> None:
        """Set ``ctx.saved`` of each covered op to a record of *that op's*
        ``saved_type`` (or leave it None), holding only what ``ctx.needs`` asks for.

        The backward is planned separately, so whichever backward stage covers an op
        reads the op's own layout: a fusion must save exactly what the basic ops
        would have saved.
        """
        raise NotImplementedError(f"{type(self).__name__} must define save_for_backward()")

    def backward_args(self, grad_output, grad_extra_outputs: tuple, ctxs: tuple) -> Any:
        """Pack the backward stage's arguments.

        Parameters
        ----------
        grad_output : Tensor or Float8Tensor
            The gradient of the stage output (a Float8Tensor only where
            ``grad_format`` asked for one).
        grad_extra_outputs : tuple of (Tensor or None)
            Gradients of the extra outputs the covered ``MakeExtraOutput`` ops branched.
        ctxs : tuple of OperationContext
            One per covered op, with ``saved`` as its forward stage left it.

        Returns
        -------
        bwd_args_type
        """
        raise NotImplementedError(f"{type(self).__name__} must define backward_args()")

    @classmethod
    def backward_compute(cls, args, *, in_custom_op: bool = False) -> BackwardResult:
        """Compute the backward from ``args`` alone (``in_custom_op`` as in
        :meth:`forward_compute`); None for each gradient that is not needed.

        Returns
        -------
        BackwardResult
        """
        raise NotImplementedError(f"{cls.__name__} must define backward_compute()")

    # A split backward (fusible.split_backward): ``dgrad_compute(args, *, in_custom_op)``
    # returns ``(BackwardResult of the dgrad lane, the args record its wgrad reads)`` and
    # ``wgrad_compute(record, *, in_custom_op)`` the deferred parameter gradients; both
    # classmethods, as backward_compute. None: the stage's backward does not split.
    dgrad_compute: ClassVar[Any] = None
    wgrad_compute: ClassVar[Any] = None

    def deferred_params(self, recipe, needs: tuple) -> "tuple | str":
        """Which of the stage's parameters a split backward defers to its wgrad lane.

        Parameters
        ----------
        recipe : object or None
            The FP8 recipe in effect.
        needs : tuple of OpGradNeeds
            The covered ops' gradient needs.

        Returns
        -------
        tuple of bool or str
            One flag per covered parameter (True: ``wgrad_compute`` computes it, and
            ``dgrad_compute`` returns None for it; False: the dgrad lane computes it), or
            the reason the stage's backward cannot split. The default defers every
            parameter of a class that defines ``dgrad_compute`` and ``wgrad_compute``.
        """
        cls = type(self)
        if cls.dgrad_compute is None or cls.wgrad_compute is None:
            return (f"{cls.__name__} defines no dgrad_compute / wgrad_compute: its backward "
                    f"computes every gradient in one stage")
        return tuple(True for op in self.basic_ops() for _ in op.param_names)

    def input_format(self, recipe, needs: tuple) -> Any:
        """Under ``recipe``, the ``Float8Format`` this forward stage takes its input in,
        or None for a plain tensor. The stage before it then hands the input over in
        that format (quantizing inside its own stage).

        Parameters
        ----------
        recipe : object
            The FP8 recipe in effect (never None here).
        needs : tuple of OpGradNeeds
            The covered ops' gradient needs (e.g. whether wgrad needs the input's
            transposed copy).
        """
        return None

    def grad_format(self, recipe, needs: tuple) -> Any:
        """Like :meth:`input_format`, for the gradient this backward stage receives."""
        return None

    def inline_when_compiled(self, direction: str) -> bool:
        """Whether the compiled graph runs this ``direction`` stage's compute inline rather
        than as its custom op: for a compute of aliases and views, no kernel of its own
        (AddExtraInput's backward hands ``dy`` on twice), and for one that writes into its
        inputs (``AddExtraInput(in_place=True)`` and the fusions covering it). A custom op
        may return no alias of its inputs, so through one each alias would be a copy the
        eager run does not make: a pass over memory and a buffer more at the peak; nor may
        it write into them."""
        return False

    def compile_unsupported_reason(self, direction: str) -> Optional[str]:
        """A reason of the stage's own why its ``direction`` stage cannot run compiled,
        or None. (Args that cannot become a custom-op schema are found by the runtime;
        the plan shows either reason.)"""
        return None


def defines(cls, attr: str, base: type) -> bool:
    """Whether ``attr`` is set on a class between ``cls`` and ``base`` (exclusive)."""
    for klass in cls.__mro__:
        if klass is base:
            return False
        if attr in vars(klass) and vars(klass)[attr] is not None:
            return True
    return False


def check_stage_class(cls, kind: str, base: type, directions: tuple) -> None:
    """Raise TypeError naming ``cls`` (a ``kind``: "fusion" or "basic operation") and the
    missing or malformed hooks of ``directions``."""
    name = f"{kind} {cls.__name__}"
    for direction in directions:
        missing = [h for h in (ARGS_TYPES[direction],) + HOOKS[direction]
                   if not defines(cls, h, base)]
        if missing:
            raise TypeError(f"{name} ({direction}) must define {', '.join(missing)} (see "
                            f"fusible.core.stage.StageSpec for each hook's contract)")
        args_type = getattr(cls, ARGS_TYPES[direction])
        if not (inspect.isclass(args_type) and attrs.has(args_type)):
            raise TypeError(f"{name}: its args type must be an attrs class "
                            f"({ARGS_TYPES[direction]} = {args_type!r})")
        compute = getattr(cls, f"{direction}_compute")
        if not inspect.ismethod(compute):
            raise TypeError(f"{name}: {direction}_compute must be a classmethod")
        wanted = ("in_custom_op", "output_format") if cls.quantizes_own_output else ("in_custom_op",)
        params = inspect.signature(compute).parameters
        open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        lacking = [w for w in wanted if w not in params and not open_kwargs]
        if lacking:
            raise TypeError(f"{name}: {direction}_compute must take the keyword argument(s) "
                            f"{', '.join(lacking)}")
