"""Runs a plan: one autograd.Function per group of basic ops.

The forward runs each forward stage in turn; the backward runs the backward
stages, which the planner chose independently, and exchange state with the
forward through one :class:`~fusible.ops.base.OperationContext` per basic op.
Only the gradients that are needed are computed (the plan knows what requires
grad), and each op's saved tensors are dropped as soon as its backward stage
has run, so intermediates are freed during the backward pass.
"""

from __future__ import annotations

import attrs
import torch

from fusible import _epoch
from fusible.ops.base import OperationContext, OpGradNeeds
from fusible.planner import GroupPlan, PlanEnvironment, op_grad_needs, plan_group


@attrs.frozen
class _ExecStage:
    """A stage with the slices of the group's per-op state it reads and writes."""

    op: object
    ops: tuple          # covered basic ops, forward order
    lo: int             # covered ops: [lo, hi) in the group
    hi: int
    extra_in: slice     # extra inputs consumed by covered ops
    extra_out: slice    # extra outputs produced by covered ops
    params: slice       # parameters of covered ops


@attrs.frozen
class ExecPlan:
    """A :class:`GroupPlan` prepared for execution."""

    group: GroupPlan
    forward: tuple
    backward: tuple     # only stages that take part in the backward pass
    needs: tuple        # OpGradNeeds per op
    needs_backward: bool
    input_needs_grad: bool
    num_params: int
    num_extra_inputs: int
    idle_ctxs: tuple    # contexts for calls that save nothing


class PipelineRunner:
    """Plans (with a cache) and runs one group of basic ops."""

    def __init__(self, ops: tuple, start: int):
        self.ops = tuple(ops)
        self.start = start
        self.epoch = _epoch.current()
        self.num_extra_inputs = sum(op.num_extra_inputs for op in self.ops)
        self.num_extra_outputs = sum(op.num_extra_outputs for op in self.ops)
        self._plans: dict = {}

    def params(self) -> list:
        return [p for op in self.ops for p in op.fusible_params()]

    def run(self, x, extra_inputs: tuple):
        """Run the group; returns (output, tuple of extra outputs)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._name()} expects a tensor input, got {type(x).__name__}")
        if len(extra_inputs) != self.num_extra_inputs:
            raise TypeError(f"{self._name()} expects {self.num_extra_inputs} extra input(s) "
                            f"for its AddExtraInput ops, got {len(extra_inputs)}")
        params = self.params()
        plan = self.plan_for_call(x, extra_inputs, params)
        if not plan.needs_backward:
            return run_forward(plan, x, extra_inputs, plan.idle_ctxs, save=False)
        outputs = _PipelineFunction.apply(plan, x, *extra_inputs, *params)
        if self.num_extra_outputs == 0:
            return outputs, ()
        return outputs[0], tuple(outputs[1:])

    def plan_for_call(self, x, extra_inputs, params) -> ExecPlan:
        grad = torch.is_grad_enabled()
        if not grad:
            return self.lookup(x.dtype, x.device.type, False, False, (), ())
        return self.lookup(x.dtype, x.device.type, True, x.requires_grad,
                           tuple(p.requires_grad for p in params),
                           tuple(e.requires_grad for e in extra_inputs))

    def lookup(self, dtype, device_type, grad_enabled, input_rg, params_rg, extras_rg) -> ExecPlan:
        """The cached plan for these conditions, planned on first use.

        What requires grad matters only with grad enabled; the key ignores it otherwise.
        """
        key = ((dtype, device_type, input_rg, params_rg, extras_rg) if grad_enabled
               else (dtype, device_type))
        plan = self._plans.get(key)
        if plan is None:
            extras_rg = extras_rg if grad_enabled else (False,) * self.num_extra_inputs
            plan = self.prepare(dtype, device_type, grad_enabled, input_rg, extras_rg)
            self._plans[key] = plan
        return plan

    def prepare(self, dtype, device_type, grad_enabled, input_rg, extra_rg) -> ExecPlan:
        """Plan the group for these conditions (uncached)."""
        needs = op_grad_needs(self.ops, grad_enabled, input_rg, tuple(extra_rg))
        env = PlanEnvironment(device_type, dtype, grad_enabled,
                              {self.start + i: n for i, n in enumerate(needs)})
        group = plan_group(self.ops, self.start, env)
        forward = tuple(self._exec_stage(s) for s in group.forward)
        backward = tuple(es for es in (self._exec_stage(s) for s in group.backward)
                         if any(n.any for n in needs[es.lo:es.hi]))
        idle = tuple(OperationContext(OpGradNeeds(False, (False,) * len(op.fusible_params()),
                                                  (False,) * op.num_extra_inputs))
                     for op in self.ops)
        return ExecPlan(group, forward, backward, needs, any(n.any for n in needs),
                        needs[0].input if needs else False,
                        sum(len(op.fusible_params()) for op in self.ops),
                        self.num_extra_inputs, idle)

    def _exec_stage(self, stage) -> _ExecStage:
        lo, hi = stage.indices[0] - self.start, stage.indices[-1] + 1 - self.start

        def span(count):
            a = sum(count(op) for op in self.ops[:lo])
            return slice(a, a + sum(count(op) for op in self.ops[lo:hi]))

        return _ExecStage(stage.op, self.ops[lo:hi], lo, hi,
                          span(lambda op: op.num_extra_inputs),
                          span(lambda op: op.num_extra_outputs),
                          span(lambda op: len(op.fusible_params())))

    def _name(self) -> str:
        return "Sequential(" + ", ".join(type(op).__name__ for op in self.ops) + ")"


def run_forward(plan: ExecPlan, x, extra_inputs, ctxs, *, save: bool):
    """Run the forward stages; returns (output, tuple of extra outputs)."""
    extra_outputs = []
    dtype, device = x.dtype, x.device
    for st in plan.forward:
        extras = extra_inputs[st.extra_in]
        _validate(st, x.shape, dtype, device, extras)
        op = st.op
        args = op.forward_args(x, extras, ctxs[st.lo:st.hi])
        result = type(op).forward_compute(args)
        if save:
            op.save_for_backward(args, result, ctxs[st.lo:st.hi])
        if len(result.extra_outputs) != st.extra_out.stop - st.extra_out.start:
            raise RuntimeError(f"{type(op).__name__} returned {len(result.extra_outputs)} extra "
                               f"outputs for ops {[type(o).__name__ for o in st.ops]}")
        x = result.output
        extra_outputs.extend(result.extra_outputs)
    return x, tuple(extra_outputs)


def _validate(st, shape, dtype, device, extras) -> None:
    pos = 0
    for op in st.ops:
        k = op.num_extra_inputs
        shape = op.validate(shape, dtype, device, extras[pos:pos + k])
        pos += k


def run_backward(plan: ExecPlan, grad_output, grad_extra_outputs, ctxs):
    """Run the backward stages; returns (grad_input, grad_extra_inputs, grad_params)."""
    grad_params = [None] * plan.num_params
    grad_extras = [None] * plan.num_extra_inputs
    dy = grad_output
    for st in plan.backward:
        op = st.op
        args = op.backward_args(dy, grad_extra_outputs[st.extra_out], ctxs[st.lo:st.hi])
        result = type(op).backward_compute(args)
        if len(result.grad_params) != st.params.stop - st.params.start:
            raise RuntimeError(f"{type(op).__name__} returned {len(result.grad_params)} "
                               f"parameter gradients for ops {[type(o).__name__ for o in st.ops]}")
        dy = result.grad_input
        grad_params[st.params] = result.grad_params
        grad_extras[st.extra_in] = result.grad_extra_inputs
        for c in ctxs[st.lo:st.hi]:
            c.clear()
    return (dy if plan.input_needs_grad else None), grad_extras, grad_params


class _SavedRef:
    """Placeholder in ``ctx.saved`` for a tensor kept through ``save_for_backward``."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def stash_saved(fctx, ctxs, protected) -> None:
    """Keep saved tensors for backward.

    Inputs and outputs of the autograd.Function go through
    ``save_for_backward`` (version checks; no reference cycle through an
    output's grad_fn). Intermediates stay referenced by the op contexts only, so
    dropping a context in the backward frees them.
    """
    ids = {id(t) for t in protected}
    to_save = []
    for c in ctxs:
        if any(t is not None and id(t) in ids for t in c.saved):
            slots = []
            for t in c.saved:
                if t is not None and id(t) in ids:
                    slots.append(_SavedRef(len(to_save)))
                    to_save.append(t)
                else:
                    slots.append(t)
            c.saved = tuple(slots)
    fctx.save_for_backward(*to_save)
    fctx.fusible_ctxs = ctxs


def restore_saved(fctx) -> list:
    ctxs = getattr(fctx, "fusible_ctxs", None)
    if ctxs is None:
        raise RuntimeError("fusible frees saved intermediates during the backward pass: "
                           "backward through the same graph twice (retain_graph=True) is not "
                           "supported; run the forward again")
    kept = fctx.saved_tensors
    for c in ctxs:
        if any(isinstance(t, _SavedRef) for t in c.saved):
            c.saved = tuple(kept[t.index] if isinstance(t, _SavedRef) else t for t in c.saved)
    del fctx.fusible_ctxs
    return ctxs


class _PipelineFunction(torch.autograd.Function):
    """A whole planned group as one autograd node."""

    @staticmethod
    def forward(fctx, plan: ExecPlan, x, *tensors):
        extra_inputs = tensors[:plan.num_extra_inputs]
        ctxs = [OperationContext(n) for n in plan.needs]
        y, extra_outputs = run_forward(plan, x, extra_inputs, ctxs, save=True)
        stash_saved(fctx, ctxs, (x, *tensors, y, *extra_outputs))
        fctx.plan = plan
        return (y, *extra_outputs) if extra_outputs else y

    @staticmethod
    def backward(fctx, grad_output, *grad_extra_outputs):
        plan = fctx.plan
        ctxs = restore_saved(fctx)
        dx, grad_extras, grad_params = run_backward(plan, grad_output, grad_extra_outputs, ctxs)
        return (None, dx, *grad_extras, *grad_params)
