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

from fusible import _epoch, custom_ops
from fusible.quantization.recipe import fp8_recipe
from fusible.ops.base import OperationContext, OpGradNeeds
from fusible.planner import GroupPlan, PlanEnvironment, op_grad_needs, plan_group
from fusible.saved import restore_saved, stash_saved


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
    compute: object     # the op's forward_compute or backward_compute (bound classmethod)
    provenance: str     # names the stage in compiled graphs
    grad_mask: tuple = ()  # backward: (input, params, extra inputs) gradients needed
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


class PipelineRunner:
    """Plans (with a cache) and runs one group of basic ops."""

    def __init__(self, ops: tuple, start: int):
        self.ops = tuple(ops)
        self.start = start
        self.epoch = _epoch.current()
        self.num_extra_inputs = sum(op.num_extra_inputs for op in self.ops)
        self.num_extra_outputs = sum(op.num_extra_outputs for op in self.ops)
        self._plans: dict = {}
        self._param_slots = [(op._parameters, name) for op in self.ops for name in op.param_names]
        self._extra_output_producers = [i for i, op in enumerate(self.ops)
                                        for _ in range(op.num_extra_outputs)]

    def params(self) -> list:
        """The ops' parameters, read afresh each call (they may have been swapped)."""
        return [params[name] for params, name in self._param_slots]

    def run(self, x, extra_inputs: tuple, params=None, traced: bool = False):
        """Run the group; returns (output, tuple of extra outputs).

        ``traced`` runs the stages' custom ops (the compiled path) on the given
        ``params``, the tensors the compiled graph passes for ``self.params()``.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._name()} expects a tensor input, got {type(x).__name__}")
        if len(extra_inputs) != self.num_extra_inputs:
            raise TypeError(f"{self._name()} expects {self.num_extra_inputs} extra input(s) "
                            f"for its AddExtraInput ops, got {len(extra_inputs)}")
        if extra_inputs and not all(isinstance(e, torch.Tensor) for e in extra_inputs):
            raise TypeError(f"{self._name()} expects tensor extra inputs, got "
                            f"{[type(e).__name__ for e in extra_inputs]}")
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            raise RuntimeError(f"{self._name()} does not run under torch.autocast: its ops take "
                               f"the dtype of their parameters; convert the model with .to(dtype) "
                               f"instead")
        params = self.params() if params is None else list(params)
        if torch.is_grad_enabled():
            rg = (x.requires_grad, tuple([p.requires_grad for p in params]),
                  tuple([e.requires_grad for e in extra_inputs]))
        else:
            rg = None
        key = (x.dtype, device_type, rg, fp8_recipe())
        plan = self._plans.get(key) or self._plan_for_key(key)
        if not plan.needs_backward:
            return run_forward(plan, x, params, extra_inputs, plan.idle_ctxs, save=False,
                               traced=traced)
        outputs = _apply(plan, traced, x, *extra_inputs, *params)
        if self.num_extra_outputs == 0:
            return outputs, ()
        return outputs[0], tuple(outputs[1:])

    def lookup(self, dtype, device_type, grad_enabled, input_rg, params_rg, extras_rg,
               recipe=None) -> ExecPlan:
        """The cached plan for these conditions, planned on first use.

        What requires grad matters only with grad enabled; the key ignores it otherwise.
        """
        key = (dtype, device_type, (input_rg, tuple(params_rg), tuple(extras_rg))
               if grad_enabled else None, recipe)
        return self._plans.get(key) or self._plan_for_key(key)

    def _plan_for_key(self, key) -> ExecPlan:
        dtype, device_type, rg, recipe = key
        input_rg, _, extras_rg = rg or (False, (), (False,) * self.num_extra_inputs)
        plan = self.prepare(dtype, device_type, rg is not None, input_rg, extras_rg, recipe)
        self._plans[key] = plan
        return plan

    def prepare(self, dtype, device_type, grad_enabled, input_rg, extra_rg,
                recipe=None) -> ExecPlan:
        """Plan the group for these conditions (uncached)."""
        needs = op_grad_needs(self.ops, grad_enabled, input_rg, tuple(extra_rg))
        env = PlanEnvironment(device_type, dtype, grad_enabled,
                              {self.start + i: n for i, n in enumerate(needs)}, recipe)
        group = plan_group(self.ops, self.start, env)
        forward = tuple(self._exec_stage(s, False, needs) for s in group.forward)
        backward = [(self._exec_stage(s, True, needs), s) for s in group.backward]
        backward = [(es, s) for es, s in backward if any(n.any for n in needs[es.lo:es.hi])]
        idle = tuple(OperationContext(OpGradNeeds(False, (False,) * len(op.fusible_params()),
                                                  (False,) * op.num_extra_inputs), recipe)
                     for op in self.ops)
        constant = tuple(j for j, i in enumerate(self._extra_output_producers)
                         if not needs[i].input)
        return ExecPlan(group, self.ops, forward, tuple(es for es, _ in backward), needs,
                        any(n.any for n in needs), needs[0].input if needs else False,
                        sum(len(op.param_names) for op in self.ops), self.num_extra_inputs, idle,
                        constant, tuple(stage for _, stage in backward), recipe)

    def _exec_stage(self, stage, backward: bool, op_needs: tuple) -> _ExecStage:
        lo, hi = stage.indices[0] - self.start, stage.indices[-1] + 1 - self.start

        def span(count):
            a = sum(count(op) for op in self.ops[:lo])
            return slice(a, a + sum(count(op) for op in self.ops[lo:hi]))

        compute = (type(stage.op).backward_compute if backward
                   else type(stage.op).forward_compute)
        ops = self.ops[lo:hi]
        provenance = (f"{stage.name} {list(stage.indices)}: "
                      + " + ".join(op.describe() for op in ops))
        mask = ()
        if backward:
            needs = [op_needs[i] for i in range(lo, hi)]
            mask = (needs[0].input, tuple(p for n in needs for p in n.params),
                    tuple(e for n in needs for e in n.extra_inputs))
        return _ExecStage(stage.op, ops, lo, hi, span(lambda op: op.num_extra_inputs),
                          span(lambda op: op.num_extra_outputs),
                          span(lambda op: len(op.param_names)), compute, provenance, mask)

    def _name(self) -> str:
        return "Sequential(" + ", ".join(type(op).__name__ for op in self.ops) + ")"


def run_forward(plan: ExecPlan, x, params, extra_inputs, ctxs, *, save: bool,
                traced: bool = False):
    """Run the forward stages; returns (output, tuple of extra outputs).

    ``traced``: through the stages' custom ops (the compiled path), else by calling
    the compute methods directly.
    """
    if traced or (x.shape, x.device) not in plan.validated or extra_inputs:
        _validate(plan, x, extra_inputs, cache=not traced)  # symbolic shapes: no cache
    # Same layouts in eager and compiled runs: the kernels (GEMMs, reductions) and so the
    # bits can depend on the input's strides, which a compiled graph may change.
    x = x.contiguous()
    if extra_inputs:
        extra_inputs = tuple(e.contiguous() for e in extra_inputs)
    extra_outputs = []
    for st in plan.forward:
        op, op_ctxs = st.op, ctxs[st.lo:st.hi]
        args = op.forward_args(x, params[st.params],
                               extra_inputs[st.extra_in] if st.num_extra_in else (), op_ctxs)
        result = (custom_ops.call_forward(st, args, st.provenance, plan.fp8_dtype) if traced
                  else st.compute(args))
        if save:
            op.save_for_backward(args, result, op_ctxs)
        if len(result.extra_outputs) != st.num_extra_out:
            raise RuntimeError(f"{type(op).__name__} returned {len(result.extra_outputs)} extra "
                               f"outputs for ops {[type(o).__name__ for o in st.ops]}")
        x = result.output
        if st.num_extra_out:
            extra_outputs.extend(result.extra_outputs)
    return x, tuple(extra_outputs)


def _validate(plan: ExecPlan, x, extra_inputs, cache: bool = True) -> None:
    """Let every op check the shape, dtype and device it will see (once per signature).

    Shapes are inferred op by op, so ops inside a fused stage are checked too.
    """
    if cache:
        signature = (x.shape, x.device, *[(e.shape, e.dtype, e.device) for e in extra_inputs])
        if signature in plan.validated:
            return
    shape, pos = tuple(x.shape), 0
    for st in plan.forward:
        for op in st.ops:
            k = op.num_extra_inputs
            if plan.recipe is not None:
                op.validate_fp8(shape)
            shape = op.validate(shape, x.dtype, x.device, extra_inputs[pos:pos + k])
            pos += k
    if cache:
        if len(plan.validated) > 256:  # many distinct shapes: keep the cache small
            plan.validated.clear()
        plan.validated[signature] = True


def run_backward(plan: ExecPlan, grad_output, grad_extra_outputs, ctxs, traced: bool = False):
    """Run the backward stages; returns (grad_input, grad_extra_inputs, grad_params)."""
    grad_params = [None] * plan.num_params
    grad_extras = [None] * plan.num_extra_inputs
    dy = grad_output.contiguous()  # e.g. the expanded gradient of .sum(): see run_forward
    if grad_extra_outputs:
        grad_extra_outputs = tuple(g.contiguous() for g in grad_extra_outputs)
    for st in plan.backward:
        op, op_ctxs = st.op, ctxs[st.lo:st.hi]
        args = op.backward_args(dy, grad_extra_outputs[st.extra_out] if st.num_extra_out else (),
                                op_ctxs)
        result = (custom_ops.call_backward(st, args, st.provenance, plan.fp8_dtype) if traced
                  else st.compute(args))
        if len(result.grad_params) != st.num_params:
            raise RuntimeError(f"{type(op).__name__} returned {len(result.grad_params)} "
                               f"parameter gradients for ops {[type(o).__name__ for o in st.ops]}")
        dy = result.grad_input
        if st.num_params:
            grad_params[st.params] = result.grad_params
        if len(result.grad_extra_inputs) != st.num_extra_in:
            raise RuntimeError(f"{type(op).__name__} returned {len(result.grad_extra_inputs)} "
                               f"extra-input gradients for ops {[type(o).__name__ for o in st.ops]}")
        if st.num_extra_in:
            grad_extras[st.extra_in] = result.grad_extra_inputs
        for c in op_ctxs:
            c.clear()
    return (dy if plan.input_needs_grad else None), grad_extras, grad_params


class _PipelineFunction(torch.autograd.Function):
    """A whole planned group as one autograd node."""

    @staticmethod
    def forward(fctx, plan: ExecPlan, traced: bool, x, *tensors):
        extra_inputs, params = tensors[:plan.num_extra_inputs], tensors[plan.num_extra_inputs:]
        ctxs = [OperationContext(n, plan.recipe) for n in plan.needs]
        y, extra_outputs = run_forward(plan, x, params, extra_inputs, ctxs, save=True,
                                       traced=traced)
        stash_saved(fctx, ctxs, (x, *tensors), (y, *extra_outputs))
        fctx.fusible = plan, ctxs, traced
        if plan.constant_extra_outputs:
            fctx.mark_non_differentiable(*(extra_outputs[j] for j in plan.constant_extra_outputs))
        return (y, *extra_outputs) if extra_outputs else y

    @staticmethod
    def backward(fctx, grad_output, *grad_extra_outputs):
        if torch.is_grad_enabled():
            raise RuntimeError("fusible pipelines are differentiable once: double backward "
                               "(create_graph=True) is not supported, since saved "
                               "intermediates carry no autograd history")
        plan, ctxs, traced = fctx.fusible
        fctx.fusible = plan, None, traced  # the contexts are consumed: backward runs once
        ctxs = restore_saved(fctx, ctxs, plan.ops)
        dx, grad_extras, grad_params = run_backward(plan, grad_output, grad_extra_outputs, ctxs,
                                                    traced)
        return (None, None, dx, *grad_extras, *grad_params)


# torch.autograd.Function.apply wraps the C++ apply in Python for functorch transforms
# (vmap, grad) and setup_context; plain eager calls can skip that layer (a few us per
# call). torch.compile and functorch transforms get the public apply.
_cpp_apply = super(torch.autograd.Function, _PipelineFunction).apply
if type(_cpp_apply) is not type(torch.ones):  # not the C++ method: keep the public path
    _cpp_apply = _PipelineFunction.apply


def _apply(plan, traced, *tensors):
    # Traced runs come from fusible.compiled (dynamo, AOTAutograd); eager runs are never
    # reached while dynamo traces (it traces fusible.compiled instead).
    if traced or torch._C._are_functorch_transforms_active():
        return _PipelineFunction.apply(plan, traced, *tensors)
    return _cpp_apply(plan, traced, *tensors)
