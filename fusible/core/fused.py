"""FusedOperation: the base class of fusions."""

from __future__ import annotations

from typing import Any, ClassVar

from fusible.core.pattern import Match
from fusible.core.stage import FORMAT_HOOKS, StageSpec, defines


class FusedOperation(StageSpec):
    """Base class of fusions: a stage that covers a run of basic ops and owns nothing.

    A fusion is declared by its class attributes and registered with
    :func:`fusible.register_fusion`, which checks it:

    ``direction``
        ``"forward"`` or ``"backward"``: the two passes are planned separately; or
        ``"both"``, a *joint* fusion that owns both passes of the ops it covers (below).
    ``pattern``
        A :class:`fusible.Pattern` over basic-op types, written in forward (model)
        order for both directions.
    ``fwd_args_type`` / ``bwd_args_type`` and the compute hooks of its direction
        As for basic ops (:class:`~fusible.core.stage.StageSpec`).
    ``priority`` (optional, default 0)
        Among accepted matches of equal length the higher priority wins, then the
        fusion registered first.
    ``handles_communication`` (optional)
        The fusion runs the collectives of the ops it covers; without it the planner
        refuses it over ops that communicate.
    ``rounds_gradient_before`` (optional)
        Pattern names of covered ops (not the first) whose input gradient the backward
        stage rounds to the model's dtype before going on (BackwardActivationBias sums
        the rounded activation gradient into the bias gradient, as torch.nn does): the
        FP64 reference of ``fusible.testing`` rounds there too.
    ``rounds_output_after`` (optional)
        Likewise for the forward: pattern names of covered ops (not the last) whose output
        the forward stage rounds to the model's dtype before going on.
    ``consumable_saved`` (optional, joint fusions)
        Fields of its ``saved_type`` whose tensor the backward may overwrite (write a
        gradient of the same size over it) where its context alone holds it: the runtime
        lists those it may in ``ctx.owned`` (never a tensor the caller passed or got,
        a view, one another context also saved, under saved-tensors hooks, or in a
        trace: a compiled stage never overwrites its inputs).

    and, optionally, ``accepts(match, env)`` returning True or the reason for
    refusing a structural match. The planner constructs the fusion with the
    :class:`~fusible.core.pattern.Match`; ``self.match["name"]`` gives a named op.

    **The equivalence contract.** A fusion computes what the basic ops it covers
    compute, and keeps nothing of its own: parameters belong to the basic ops
    (``forward_args`` receives them), per-call state to their contexts. Because the
    other pass is planned independently, a forward fusion must leave each covered
    op's ``ctx.saved`` exactly as that op's own forward would (its ``saved_type``,
    the same tensors), and a backward fusion must read them so. The runtime checks the
    record types.

    **Joint fusions** (``direction = "both"``) define the hooks of both passes and a
    ``saved_type`` of their own: the planner gives a joint match both passes of its ops
    (it is planned first, and the forward and backward scans go around it), so the
    backward stage is always this fusion and may read what its forward saved rather than
    the basic ops' records. That is the one exception to the equivalence contract: its
    forward stores one record of its ``saved_type`` in the first covered op's context
    and nothing in the others', and may save less than the basic ops would (recomputing
    the rest). The computed values stay those of the basic ops.

    **FP8.** Under a recipe, a fusion over an op that quantizes in the fusion's
    direction (``op.quantizes(recipe, direction)``, e.g. ``BasicLinear``) must define
    its own ``input_format`` (forward) or ``grad_format`` (backward), saying in which
    format it takes its input or gradient (None: plain, quantizing inside); otherwise
    the planner refuses it under the recipe, and the plan says why.
    """

    direction: ClassVar[str] = ""
    saved_type: ClassVar[Any] = None  # joint fusions: the record their forward saves
    pattern: ClassVar[Any] = None
    priority: ClassVar[int] = 0
    handles_communication: ClassVar[bool] = False
    rounds_gradient_before: ClassVar[tuple] = ()
    rounds_output_after: ClassVar[tuple] = ()
    consumable_saved: ClassVar[tuple] = ()

    def __init__(self, match: Match):
        self.match = match

    def basic_ops(self) -> tuple:
        return self.match.ops

    @classmethod
    def accepts(cls, match, env) -> "bool | str":
        """Return True to accept a structural match, or a string saying why not.

        Parameters
        ----------
        match : fusible.core.pattern.Match
            The matched ops (``match["name"]``, ``match.ops``, ``match.indices``).
        env : fusible.PlanEnvironment
            Device type, dtype, grad mode, recipe and each op's gradient needs
            (``env.needs[index]``).
        """
        return True

    @classmethod
    def declares_format(cls) -> bool:
        """Whether the class defines the format hook of its direction (both hooks for a
        joint fusion) itself."""
        return all(defines(cls, FORMAT_HOOKS[d], FusedOperation) for d in cls.directions())

    @classmethod
    def directions(cls) -> tuple:
        """The passes the fusion plans: ``("forward", "backward")`` for a joint one."""
        return ("forward", "backward") if cls.direction == "both" else (cls.direction,)

    @classmethod
    def example(cls):
        """A small :class:`~fusible.core.example.Example` in which the planner chooses
        this fusion, for the test matrices; None if the fusion has none."""
        return None

    def reference(self, x, extra_inputs: tuple, params: tuple) -> tuple:
        """The covered basic ops' references, in order (a fusion computes what they do)."""
        extra_outputs, pos = [], 0
        for op in self.basic_ops():
            k, n = op.num_extra_inputs, len(op.param_names)
            x, outs = op.reference(x, extra_inputs[:k], params[pos:pos + n])
            extra_inputs, pos = extra_inputs[k:], pos + n
            extra_outputs += outs
        return x, tuple(extra_outputs)

    def describe(self) -> str:
        return f"{type(self).__name__}({', '.join(op.describe() for op in self.basic_ops())})"

    def __repr__(self) -> str:
        return self.describe()
