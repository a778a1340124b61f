"""Runs a plan: one autograd.Function per group of basic ops.

The forward runs each forward stage in turn; the backward runs the backward
stages, which the planner chose independently, and exchange state with the
forward through one :class:`~fusible.core.context.OperationContext` per basic op.
Only the gradients that are needed are computed (the plan knows what requires
grad), and each op's saved tensors are dropped as soon as its backward stage
has run, so intermediates are freed during the backward pass.

Execution features run through the hooks the runtime bound into the plan (``plan.hooks``,
:mod:`fusible.runtime.features`): a plan without features runs the loops below and
nothing else.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref
from typing import Any, Optional, Sequence, cast

import torch

from fusible.core.context import OperationContext
from fusible.planning.exec_plan import ExecPlan
from fusible.quantization.format import to_format
from fusible.runtime import custom_ops
from fusible.runtime.saved import restore_saved, stash_saved
from fusible.runtime.validate import validate


# What a pass of a plan whose features keep nothing per pass (``RuntimeFeature.uses_store``)
# gets as its store: read-only, so that a feature writing into it fails loudly
_NO_STORE: types.MappingProxyType = types.MappingProxyType({})


def _untraced_by_dynamo(fn):
    """``fn`` never a frame dynamo traces, once dynamo is loaded (``import fusible`` does
    not load it). Compiled graphs differentiate through AOTAutograd; a step compiled whole
    by dynamo alone has the engine call the pipeline's backward inside the compiled call
    (on the CPU's thread), where PyTorch 2.13's resumed frames mixed up its stages."""
    @functools.wraps(fn)
    def run(*args):
        if "torch._dynamo" not in sys.modules:  # nothing can be tracing it
            return fn(*args)
        return _dynamo_disabled(fn)(*args)
    return run


@functools.cache
def _dynamo_disabled(fn):
    return torch._dynamo.disable(fn)


class Call:
    """The state of one pass of a plan's stages, which the hooks read and write.

    ``input`` is the pass's first input (the group's input, or the output's gradient).
    Forward: ``extras`` are the extra inputs by the ops' slots, ``outputs`` the extra
    outputs collected so far. Backward: ``extras`` are the gradients of the extra outputs
    by slot, ``outputs`` the gradients of the extra inputs by slot, and ``grad_params``
    the parameter gradients. ``given`` holds the caller's extra inputs as passed (forward),
    ``store`` the features' scratch space for the pass (named channels' tensors by name, or
    their gradients' sums; other features key theirs by tuples), ``owner`` the thread that
    ran the forward (the backward may run on an autograd worker), ``tensors`` the feature
    tensors of the call
    (``RuntimeFeature.count``), by feature name; ``saves``: a forward that saves for a
    backward (an autograd node's; inside it grad mode is off whatever the caller's).
    """

    __slots__ = ("plan", "ctxs", "traced", "input", "extras", "outputs", "grad_params",
                 "given", "store", "tensors", "owner", "saves")

    def __init__(self, plan, ctxs, traced: bool, input, extras, outputs: list,
                 tensors: "dict | None", given: tuple = (), owner: Optional[int] = None,
                 saves: bool = False):
        self.plan, self.ctxs, self.traced, self.input = plan, ctxs, traced, input
        self.saves = saves
        self.owner = threading.get_ident() if owner is None else owner
        self.extras, self.outputs, self.given = extras, outputs, given
        self.tensors: dict = tensors or {}
        self.grad_params: list = []
        self.store: Any = {} if plan.hooks.uses_store else _NO_STORE


def run_forward(plan: ExecPlan, x, params, extra_inputs, ctxs, *, save: bool,
                traced: bool = False, tensors: "dict | None" = None):
    """Run the forward stages; returns (output, tuple of extra outputs).

    ``traced``: through the stages' custom ops (the compiled path), else by calling
    the compute methods directly. ``tensors``: the feature tensors, by feature name.
    """
    if traced or (x.shape, x.device) not in plan.validated or extra_inputs:
        # symbolic shapes: no cache; traced, the ops check the tensors the graph gives
        validate(plan, x, extra_inputs, cache=not traced, params=params if traced else None)
    # Same layouts in eager and compiled runs: the kernels (GEMMs, reductions) and so the
    # bits can depend on the input's strides, which a compiled graph may change.
    x = x.contiguous()
    extras = tuple(e.contiguous() for e in extra_inputs) if extra_inputs else ()
    outputs: list = []
    hooks, call = plan.hooks, None
    if hooks.active:  # features act on this plan: they see the pass as a Call
        call = Call(plan, ctxs, traced, x, extras, outputs, tensors, extra_inputs, saves=save)
        for begin in hooks.begin_forward:
            begin(call)
        extras, outputs = call.extras, call.outputs
    for st, sh in zip(plan.forward, hooks.forward):
        if sh is not None:
            for before in sh.before:
                before(call, st)
        op, op_ctxs = st.op, ctxs[st.lo:st.hi]
        args = op.forward_args(x, params[st.params], extras[st.extra_in] if st.num_extra_in
                               else (), op_ctxs)
        if sh is None and not traced:  # the common case: eager, no feature on this stage
            result = st.compute(args)
            if st.output_format is not None:  # what the custom op does inside, compiled
                result.output = to_format(result.output, st.output_format)
            if len(result.extra_outputs) != st.num_extra_out:
                _check_forward_counts(st, result)
        elif sh is None:
            result = forward_result(plan, traced, st, args, st.output_format)
            if len(result.extra_outputs) != st.num_extra_out:
                _check_forward_counts(st, result)
        else:
            result = _featured_result(cast(Call, call), st, sh, args, forward_result,
                                      _check_forward_counts)
        if save:
            op.save_for_backward(args, result, op_ctxs)
        x = result.output
        if st.num_extra_out:
            outputs.extend(result.extra_outputs)
        del args, result  # free this stage's temporaries before the next stage allocates
    if call is not None:
        for end in hooks.end_forward:
            end(call)
        outputs = call.outputs
    return x, tuple(outputs)


def forward_result(plan: ExecPlan, traced: bool, st, args, fmt):
    """A forward stage's result, its output handed on in ``fmt`` (the stage's format, or a
    feature's binding of it): the custom op when ``traced``, else the compute method."""
    if traced and not st.op.inline_when_compiled("forward"):
        return custom_ops.call_forward(st, args, plan.quantized_results, plan.outer_dtype, fmt)
    result = st.compute(args) if fmt is st.output_format else _compute_with(st, args, fmt)
    if fmt is not None:  # what the custom op does inside, when compiled
        result.output = to_format(result.output, fmt)
    return result


def backward_result(plan: ExecPlan, traced: bool, st, args, fmt):
    """A backward stage's result, as :func:`forward_result`."""
    if traced and not st.op.inline_when_compiled("backward"):
        return custom_ops.call_backward(st, args, plan.quantized_results, plan.outer_dtype,
                                        fmt)
    result = st.compute(args) if fmt is st.output_format else _compute_with(st, args, fmt)
    if fmt is not None and result.grad_input is not None:
        result.grad_input = to_format(result.grad_input, fmt)
    return result


def _compute_with(st, args, fmt):
    """The stage's compute handed ``fmt`` (a format bound at the call), where its kernels
    write it; else its plain result, cast after it."""
    if st.op.__class__.quantizes_own_output:
        return st.compute(args, output_format=fmt if fmt.kernel_cast else None)
    return st.compute(args)


def run_backward(plan: ExecPlan, grad_output, grad_extra_outputs, ctxs, traced: bool = False,
                 tensors: "dict | None" = None, shapes: Sequence = (),
                 owner: Optional[int] = None):
    """Run the backward stages; returns (grad_input, grad_extra_inputs, grad_params).

    ``shapes``: the parameters' shapes, which their gradients must have; ``owner``: the
    thread that ran the forward.
    """
    dy = grad_output.contiguous()  # e.g. the expanded gradient of .sum(): see run_forward
    extras = tuple(g.contiguous() for g in grad_extra_outputs) if grad_extra_outputs else ()
    outputs: list = [None] * plan.num_extra_inputs
    grad_params: list = [None] * plan.num_params
    hooks, call = plan.hooks, None
    if hooks.active:
        call = Call(plan, ctxs, traced, dy, extras, outputs, tensors, owner=owner)
        call.grad_params = grad_params
        for begin in hooks.begin_backward:
            begin(call)
        extras, outputs = call.extras, call.outputs
    for st, sh in zip(plan.backward, hooks.backward):
        if sh is not None:
            for before in sh.before:
                before(call, st)
        op, op_ctxs = st.op, ctxs[st.lo:st.hi]
        args = op.backward_args(dy, extras[st.extra_out] if st.num_extra_out else (), op_ctxs)
        if sh is None:
            result = backward_result(plan, traced, st, args, st.output_format)
            if len(result.grad_params) != st.num_params \
                    or len(result.grad_extra_inputs) != st.num_extra_in:
                _check_backward_counts(st, result)
        else:
            result = _featured_result(cast(Call, call), st, sh, args, backward_result,
                                      _check_backward_counts)
        dy = result.grad_input
        if st.num_params:
            grad_params[st.params] = result.grad_params
        if st.num_extra_in:
            outputs[st.extra_in] = result.grad_extra_inputs
        for c in op_ctxs:
            c.clear()
        # The next stage's backward_args may allocate (an FP8 weight cast): this stage's
        # inputs (the incoming gradient, saved activations) must be gone by then.
        del args, result
    if shapes:
        _check_grad_shapes(plan, grad_params, shapes)
    if call is not None:
        for end in hooks.end_backward:
            end(call)
        outputs = call.outputs
    return (dy if plan.input_needs_grad else None), outputs, grad_params


def _featured_result(call: Call, st, sh, args, compute, check):
    """The result of a stage features act on: ``compute`` (the executor's), or a feature's
    in its place; checked, then handed to the features' ``after`` hooks."""
    if sh.compute is None:
        result = compute(call.plan, call.traced, st, args, st.output_format)
    else:
        result = sh.compute(call, st, args)
    check(st, result)
    for after in sh.after:
        after(call, st, result)
    return result


def _check_forward_counts(st, result) -> None:
    """A forward stage returns one extra output per covered extra-output slot."""
    if len(result.extra_outputs) != st.num_extra_out:
        raise RuntimeError(f"{type(st.op).__name__} returned {len(result.extra_outputs)} extra "
                           f"outputs for ops {[type(o).__name__ for o in st.ops]}")


def _check_backward_counts(st, result) -> None:
    """A backward stage returns one gradient per covered parameter and extra input."""
    for what, got, want in (("parameter", result.grad_params, st.num_params),
                            ("extra-input", result.grad_extra_inputs, st.num_extra_in)):
        if len(got) != want:
            raise RuntimeError(f"{type(st.op).__name__} returned {len(got)} {what} gradients "
                               f"for ops {[type(o).__name__ for o in st.ops]}")


def _check_grad_shapes(plan, grad_params, shapes) -> None:
    """Raise naming the stage and the parameter whose gradient has another shape than the
    parameter (autograd would sum it down to the parameter's shape silently)."""
    for g, shape in zip(grad_params, shapes):
        if g is not None and g.shape != shape:
            break
    else:
        return
    for st in plan.backward:
        owners = [(op, name) for op in st.ops for name in op.param_names]
        for k, (op, name) in zip(range(st.params.start, st.params.stop), owners):
            g = grad_params[k]
            if g is not None and g.shape != shapes[k]:
                raise RuntimeError(f"{st.op.__class__.__name__} returned a gradient of shape "
                                   f"{tuple(g.shape)} for {op.describe()}'s {name}, whose "
                                   f"shape is {tuple(shapes[k])}")


def feature_tensors(plan: ExecPlan, flat) -> dict:
    """The feature tensors of a call, flat in the plan's order, by feature name; raises
    naming the feature where their number is not the plan's."""
    found, pos = {}, 0
    for name, _, _, count in plan.hooks.tensors:
        found[name] = tuple(flat[pos:pos + count])
        if len(found[name]) != count:
            raise RuntimeError(f"{len(found[name])} {name} tensors for a plan reading {count}")
        pos += count
    if pos != len(flat):
        raise RuntimeError(f"{len(flat)} feature tensors for a plan reading {pos}")
    return found


class _PipelineFunction(torch.autograd.Function):
    """A whole planned group as one autograd node."""

    @staticmethod
    def forward(fctx, plan: ExecPlan, traced: bool, x, *tensors):
        extras_end = plan.num_extra_inputs
        params_end = extras_end + plan.num_params
        extra_inputs, params = tensors[:extras_end], tensors[extras_end:params_end]
        # Feature tensors (main_grad buffers, FP8 scaling states): held as they are (no
        # version check: other groups add into main_grad buffers between this forward and
        # its backward, e.g. microbatches; the stages update scaling states)
        features = feature_tensors(plan, tensors[params_end:]) \
            if plan.hooks.tensors or len(tensors) > params_end else {}
        ctxs = [OperationContext(n, r) for n, r in zip(plan.needs, plan.recipes())]
        y, extra_outputs = run_forward(plan, x, params, extra_inputs, ctxs, save=True,
                                       traced=traced, tensors=features)
        for node in plan.hooks.forward_node:
            node(fctx, extra_inputs, y)
        stash_saved(fctx, ctxs, plan.saved_readers, (x, *tensors[:params_end]),
                    (y, *extra_outputs), traced)
        # Traced (compiled) runs keep the plan and ops weakly: a trace may keep this node alive
        # after the module is gone (dynamo's fake propagation never runs its backward), and
        # the compiled graph does not use the node at run time.
        shapes = [p.shape for p in params]  # what each parameter gradient must match
        held = shapes, features, len(tensors) - params_end, threading.get_ident()
        if traced:
            fctx.fusible = weakref.ref(plan), ctxs, traced, (), held
        else:
            fctx.fusible = plan, ctxs, traced, _anchors(plan), held
        if plan.constant_extra_outputs:
            fctx.mark_non_differentiable(*(extra_outputs[j] for j in plan.constant_extra_outputs))
        return (y, *extra_outputs) if extra_outputs else y

    @staticmethod
    @_untraced_by_dynamo
    def backward(fctx, grad_output, *grad_extra_outputs):
        if torch.is_grad_enabled():
            raise RuntimeError("fusible pipelines are differentiable once: double backward "
                               "(create_graph=True) is not supported, since saved "
                               "intermediates carry no autograd history")
        if fctx.fusible is None:
            raise RuntimeError("fusible frees saved intermediates during the backward pass: "
                               "backward through the same graph twice (retain_graph=True) is "
                               "not supported; run the forward again")
        plan, ctxs, traced, _, (shapes, features, num_features, owner) = fctx.fusible
        plan = plan() if traced else plan
        # Consumed: backward runs once, and the node (which traces may keep) holds nothing.
        fctx.fusible = None
        ctxs = restore_saved(fctx, ctxs, plan.ops)
        dx, grad_extras, grad_params = run_backward(plan, grad_output, grad_extra_outputs, ctxs,
                                                    traced, features, shapes, owner)
        return (None, None, dx, *grad_extras, *grad_params, *(None,) * num_features)


def _anchors(plan) -> tuple:
    """The op a lone op's plan refers to weakly (its own layout must not keep it alive),
    held strongly by the autograd node until the backward has run."""
    first = plan.ops[0] if plan.ops else None
    return first.basic_ops() if first is not None and type(first) in weakref.ProxyTypes else ()


# torch.autograd.Function.apply wraps the C++ apply in Python for functorch transforms
# (vmap, grad) and setup_context; plain eager calls can skip that layer (a few us per
# call). torch.compile and functorch transforms get the public apply.
_cpp_apply = super(torch.autograd.Function, _PipelineFunction).apply
if type(_cpp_apply) is not type(torch.ones):  # not the C++ method: keep the public path
    _cpp_apply = _PipelineFunction.apply


def apply_pipeline(plan, traced, *tensors):
    """Run a group that needs a backward as one autograd node; ``tensors`` are the input,
    the extra inputs, the parameters and the feature tensors."""
    # Traced runs come from the compiled path (dynamo, AOTAutograd); eager runs are never
    # reached while dynamo traces (it traces fusible.runtime.compiled instead).
    if traced or torch._C._are_functorch_transforms_active():
        return _PipelineFunction.apply(plan, traced, *tensors)
    return _cpp_apply(plan, traced, *tensors)
