"""A group's plan prepared for execution: stage slices, gradient masks, FP8 formats."""

from __future__ import annotations

import functools

import attrs

from fusible.distributed import NOT_PARALLEL
from fusible.ops.base import OperationContext, OpGradNeeds
from fusible.planner import GroupPlan, PlanEnvironment, op_grad_needs, plan_group


@attrs.frozen
class ExecStage:
    """A stage with the slices of the group's per-op state it reads and writes.

    ``fp8_out`` is the ``(fp8_dtype, transposed copy)`` format in which the stage
    hands its output (forward) or its input gradient (backward) to the next stage,
    which consumes FP8; None when it hands over a plain tensor.
    """

    op: object
    ops: tuple          # covered basic ops, forward order
    lo: int             # covered ops: [lo, hi) in the group
    hi: int
    extra_in: slice     # extra inputs consumed by covered ops
    extra_out: slice    # extra outputs produced by covered ops
    params: slice       # parameters of covered ops
    compute: object     # the op's forward_compute or backward_compute (bound classmethod)
    provenance: str     # names the stage in compiled graphs
    grad_mask: tuple = ()  # backward: (input, params, extra inputs) gradients needed
    fp8_out: object = None
    grad_sync: tuple = ()  # backward: (parameter index in the stage, group) to all-reduce
    num_extra_in: int = attrs.field(init=False)
    num_extra_out: int = attrs.field(init=False)
    num_params: int = attrs.field(init=False)

    def __attrs_post_init__(self):  # counts read on the hot path
        for name, span in (("num_extra_in", self.extra_in), ("num_extra_out", self.extra_out),
                           ("num_params", self.params)):
            object.__setattr__(self, name, span.stop - span.start)


@attrs.frozen
class ExecPlan:
    """A :class:`GroupPlan` prepared for execution."""

    group: GroupPlan
    ops: tuple          # the group's basic ops
    forward: tuple
    backward: tuple     # only stages that take part in the backward pass
    needs: tuple        # OpGradNeeds per op
    needs_backward: bool
    input_needs_grad: bool
    num_params: int
    num_extra_inputs: int
    idle_ctxs: tuple    # contexts for calls that save nothing
    constant_extra_outputs: tuple  # extra outputs that depend on nothing requiring grad
    backward_stages: tuple  # the public Stages of `backward`
    recipe: object      # the FP8 recipe, or None
    validated: dict = attrs.field(factory=dict, eq=False)  # input signatures checked already

    @property
    def fp8_dtype(self):
        """Under an FP8 recipe, the dtype Float8Tensors dequantize to; else None."""
        return None if self.recipe is None else self.group.env.dtype


def prepare(ops: tuple, start: int, dtype, device_type, grad_enabled, input_rg, extra_rg,
            recipe=None) -> ExecPlan:
    """Plan a group of ``ops`` (the first at ``start``) for these conditions."""
    needs = op_grad_needs(ops, grad_enabled, input_rg, tuple(extra_rg))
    env = PlanEnvironment(device_type, dtype, grad_enabled,
                          {start + i: n for i, n in enumerate(needs)}, recipe)
    check_sequence_parallel(ops)
    group = plan_group(ops, start, env)
    forward = [_exec_stage(ops, start, s, False, needs) for s in group.forward]
    backward = [(_exec_stage(ops, start, s, True, needs), s) for s in group.backward]
    backward = [(es, s) for es, s in backward if any(n.any for n in needs[es.lo:es.hi])]
    forward, backward_exec = _fp8_formats(forward, [es for es, _ in backward], needs, recipe)
    idle = tuple(OperationContext(OpGradNeeds(False, (False,) * len(op.param_names),
                                              (False,) * op.num_extra_inputs), recipe)
                 for op in ops)
    producers = [i for i, op in enumerate(ops) for _ in range(op.num_extra_outputs)]
    constant = tuple(j for j, i in enumerate(producers) if not needs[i].input)
    return ExecPlan(group, ops, tuple(forward), tuple(backward_exec), needs,
                    any(n.any for n in needs), needs[0].input if needs else False,
                    sum(len(op.param_names) for op in ops),
                    sum(op.num_extra_inputs for op in ops), idle, constant,
                    tuple(stage for _, stage in backward), recipe)


def _exec_stage(ops, start, stage, backward: bool, op_needs: tuple) -> ExecStage:
    lo, hi = stage.indices[0] - start, stage.indices[-1] + 1 - start

    def span(count):
        a = sum(count(op) for op in ops[:lo])
        return slice(a, a + sum(count(op) for op in ops[lo:hi]))

    cls = type(stage.op)
    compute = cls.backward_compute if backward else cls.forward_compute
    provenance = (f"{stage.name} {list(stage.indices)}: "
                  + " + ".join(op.describe() for op in ops[lo:hi]))
    mask = ()
    if backward:
        needs = op_needs[lo:hi]
        mask = (needs[0].input, tuple(p for n in needs for p in n.params),
                tuple(e for n in needs for e in n.extra_inputs))
    sync, offset = [], 0
    for op in ops[lo:hi] if backward else ():
        tp = op.grad_reduction()
        sync += [(offset + k, tp) for k in range(len(op.param_names))] if tp else []
        offset += len(op.param_names)
    return ExecStage(stage.op, ops[lo:hi], lo, hi, span(lambda op: op.num_extra_inputs),
                     span(lambda op: op.num_extra_outputs), span(lambda op: len(op.param_names)),
                     compute, provenance, mask, grad_sync=tuple(sync))


def check_sequence_parallel(ops) -> None:
    """Ops with parameters that see tokens split over a group (before a column + SP
    linear layer, after a row + SP one) must all-reduce their gradients: an error names
    any that would not, rather than letting ranks' replicated parameters drift apart."""
    tps = [getattr(op, "tp", NOT_PARALLEL) for op in ops]
    split = [None] * len(ops)  # per op: the group its input's tokens are split over
    state = None
    for i, tp in enumerate(tps):  # after a row + SP layer, until a column + SP one
        state = None if tp.gathers_input else state
        split[i] = state
        state = tp if tp.scatters_output else state
    state = None
    for i in reversed(range(len(ops))):  # before a column + SP layer, back to a row + SP one
        tp = tps[i]
        if tp.gathers_input:
            state = tp
            continue
        state = None if tp.scatters_output else state
        split[i] = split[i] or state
    for op, tp in zip(ops, split):
        if tp is not None and op.param_names and not _parallel_param_op(op):
            raise ValueError(f"{op.describe()} sees tokens split over the tensor-parallel group "
                             f"(sequence parallelism around it), so each rank would sum only "
                             f"its own tokens into its parameter gradients: construct it with "
                             f"sequence_parallel=True")


def _parallel_param_op(op) -> bool:
    """An op whose parameters are shards, or whose gradients the fuser all-reduces."""
    tp = getattr(op, "tp", None)
    return op.grad_reduction() is not None or (tp is not None and tp.mode != "")


def _with_fp8_out(stage: ExecStage, fmt) -> ExecStage:
    compute = stage.compute
    if type(stage.op).quantizes_own_output:
        compute = functools.partial(compute, fp8_out=fmt)
    return attrs.evolve(stage, fp8_out=fmt, compute=compute)


def _gathers(stage: ExecStage, direction: str) -> bool:
    """Whether a stage communicates what it receives before computing (an all-gather):
    it quantizes that itself, with one scale for the whole group (see
    ``linear_math.gather_fp8``), so the stage before must hand it over unquantized."""
    return any(where == "before" for op in stage.ops
               for where, _ in op.communication(direction))


def _fp8_formats(forward: list, backward: list, needs: tuple, recipe):
    """Let each stage hand FP8 to a next stage that consumes it (the cast then happens in
    the producer's own compute, inside its custom op when compiled)."""
    if recipe is None:
        return forward, backward
    for k in range(len(forward) - 1):
        nxt = forward[k + 1]
        if type(nxt.op).fp8_input_consumer and not _gathers(nxt, "forward"):
            # it keeps the copy its wgrad needs
            fmt = (recipe.forward_dtype, needs[nxt.lo].params[0])
            forward[k] = _with_fp8_out(forward[k], fmt)
    for k in range(len(backward) - 1):
        nxt = backward[k + 1]
        if type(nxt.op).fp8_grad_consumer and not _gathers(nxt, "backward"):
            # its last op takes the gradient (wgrad: dy.T)
            fmt = (recipe.backward_dtype, needs[nxt.hi - 1].params[0])
            backward[k] = _with_fp8_out(backward[k], fmt)
    return forward, backward
