"""Runs a plan: one autograd.Function per group of basic ops.

The forward runs each forward stage in turn; the backward runs the backward
stages, which the planner chose independently, and exchange state with the
forward through one :class:`~fusible.core.context.OperationContext` per basic op.
Only the gradients that are needed are computed (the plan knows what requires
grad), and each op's saved tensors are dropped as soon as its backward stage
has run, so intermediates are freed during the backward pass.
"""

from __future__ import annotations

import weakref

import torch

from fusible.core.context import OperationContext
from fusible.functional import parallel
from fusible.planning.channels import channel_of
from fusible.planning.prepare import ExecPlan
from fusible.quantization.format import to_format
from fusible.runtime import custom_ops, deferred
from fusible.runtime.saved import restore_saved, stash_saved
from fusible.runtime.scaling_states import assign_states, bound_output_format, compute_into


def run_forward(plan: ExecPlan, x, params, extra_inputs, ctxs, *, save: bool,
                traced: bool = False):
    """Run the forward stages; returns (output, tuple of extra outputs).

    ``traced``: through the stages' custom ops (the compiled path), else by calling
    the compute methods directly.
    """
    if traced or (x.shape, x.device) not in plan.validated or extra_inputs:
        _validate(plan, x, extra_inputs, cache=not traced)  # symbolic shapes: no cache
    for j, op in zip(plan.in_place_extra_inputs, plan.in_place_ops):
        if not extra_inputs[j].is_contiguous():  # the sum goes into it: no copy may stand in
            raise ValueError(f"{op.describe()} writes into its extra input, which must be "
                             f"contiguous; got strides {extra_inputs[j].stride()} for shape "
                             f"{tuple(extra_inputs[j].shape)}")
    # Same layouts in eager and compiled runs: the kernels (GEMMs, reductions) and so the
    # bits can depend on the input's strides, which a compiled graph may change.
    x = x.contiguous()
    if extra_inputs:
        extra_inputs = tuple(e.contiguous() for e in extra_inputs)
    extra_outputs: list = []
    ch = plan.channels
    store: dict  # with channels: channel name -> its tensor
    if ch is not None:  # the ops' extra-input slots, the channels' filled as they are written
        extra_inputs, store = _spread(extra_inputs, ch.caller_in, len(ch.in_names)), {}
    for st in plan.forward:
        op, op_ctxs = st.op, ctxs[st.lo:st.hi]
        if ch is not None and st.num_extra_in:
            _take(extra_inputs, ch.in_names, st, store, required=True)
        args = op.forward_args(x, params[st.params],
                               extra_inputs[st.extra_in] if st.num_extra_in else (), op_ctxs)
        fmt = st.output_format if st.output_state is None else bound_output_format(st, ctxs)
        if traced and not op.inline_when_compiled("forward"):
            result = custom_ops.call_forward(st, args, plan.quantized_results, plan.outer_dtype,
                                             fmt)
        else:
            result = st.compute(args) if st.output_state is None else \
                compute_into(st, args, fmt)
            if fmt is not None:  # what the custom op does inside, when compiled
                result.output = to_format(result.output, fmt)
        if save:
            op.save_for_backward(args, result, op_ctxs)
        if len(result.extra_outputs) != st.num_extra_out:
            raise RuntimeError(f"{type(op).__name__} returned {len(result.extra_outputs)} extra "
                               f"outputs for ops {[type(o).__name__ for o in st.ops]}")
        x = result.output
        if st.num_extra_out:
            extra_outputs.extend(result.extra_outputs)
            if ch is not None:
                _keep(store, ch.out_names, st.extra_out, result.extra_outputs)
        del args, result  # free this stage's temporaries before the next stage allocates
    if ch is not None:
        extra_outputs = [extra_outputs[j] for j in ch.caller_out]
    return x, tuple(extra_outputs)


def _spread(values, slots: tuple, n: int) -> list:
    """``n`` slots, ``values`` at ``slots`` (the caller's), None elsewhere (channels')."""
    out = [None] * n
    for value, slot in zip(values, slots):
        out[slot] = value
    return out


def _take(slots: list, names: tuple, st, store: dict, required: bool) -> None:
    """Fill the stage's channel slots (``st.extra_in`` forward, ``st.extra_out`` backward)
    from ``store``: the channels' tensors, or their gradients summed so far."""
    span = st.extra_in if required else st.extra_out
    for slot in range(span.start, span.stop):
        name = names[slot]
        if name is None:
            continue
        if required and name not in store:
            raise RuntimeError(f"the stage {st.provenance} reads channel {name!r} before its "
                               f"writer has run (a fusion covering both cannot pass it on)")
        slots[slot] = store.get(name)


def _keep(store: dict, names: tuple, span: slice, values) -> None:
    """Keep the channel tensors of ``span``'s slots."""
    for slot, value in zip(range(span.start, span.stop), values):
        if names[slot] is not None:
            store[names[slot]] = value


def _sum_into(sums: dict, names: tuple, span: slice, grads) -> None:
    """Add the gradients of ``span``'s channel slots to their channels' sums."""
    for slot, g in zip(range(span.start, span.stop), grads):
        name = names[slot]
        if name is not None and g is not None:
            sums[name] = g if sums.get(name) is None else sums[name] + g


def _validate(plan: ExecPlan, x, extra_inputs, cache: bool = True) -> None:
    """Let every op check the shape, dtype and device it will see (once per signature).

    Shapes are inferred op by op, so ops inside a fused stage are checked too.
    """
    if cache:
        signature = (x.shape, x.device, *[(e.shape, e.dtype, e.device) for e in extra_inputs])
        if signature in plan.validated:
            return
    shape, pos, channels = tuple(x.shape), 0, {}
    for st in plan.forward:
        for op in st.ops:
            k, name = op.num_extra_inputs, plan.channels and channel_of(op)
            if plan.recipe is not None:
                op.validate_fp8(shape)
            if name and op.num_extra_outputs:
                channels[name] = shape
            if name and k:  # the channel's tensor: of the shape where it was written
                extras = (x.new_empty(()).expand(channels[name]),) * k
            else:
                extras, pos = extra_inputs[pos:pos + k], pos + k
            shape = op.validate(shape, x.dtype, x.device, extras)
    if cache:
        if len(plan.validated) > 256:  # many distinct shapes: keep the cache small
            plan.validated.clear()
        plan.validated[signature] = True


def run_backward(plan: ExecPlan, grad_output, grad_extra_outputs, ctxs, traced: bool = False):
    """Run the backward stages; returns (grad_input, grad_extra_inputs, grad_params)."""
    grad_params, ch = [None] * plan.num_params, plan.channels
    grad_extras = [None] * (plan.num_extra_inputs if ch is None else len(ch.in_names))
    dy = grad_output.contiguous()  # e.g. the expanded gradient of .sum(): see run_forward
    if grad_extra_outputs:
        grad_extra_outputs = tuple(g.contiguous() for g in grad_extra_outputs)
    sums: dict  # with channels: channel name -> its readers' gradients summed
    if ch is not None:  # the ops' extra-output slots; the channels' get their readers' sums
        grad_extra_outputs, sums = _spread(grad_extra_outputs, ch.caller_out,
                                           len(ch.out_names)), {}
    for st in plan.backward:
        op, op_ctxs = st.op, ctxs[st.lo:st.hi]
        if ch is not None and st.num_extra_out:
            _take(grad_extra_outputs, ch.out_names, st, sums, required=False)
        args = op.backward_args(dy, grad_extra_outputs[st.extra_out] if st.num_extra_out else (),
                                op_ctxs)
        fmt = st.output_format if st.output_state is None else bound_output_format(st, ctxs)
        if st.deferred:
            result = _run_dgrad(plan, st, args, fmt, traced)
        elif traced and not st.op.inline_when_compiled("backward"):
            result = custom_ops.call_backward(st, args, plan.quantized_results, plan.outer_dtype,
                                              fmt)
        else:
            result = st.compute(args) if st.output_state is None else \
                compute_into(st, args, fmt)
            if fmt is not None and result.grad_input is not None:
                result.grad_input = to_format(result.grad_input, fmt)
        if len(result.grad_params) != st.num_params:
            raise RuntimeError(f"{type(op).__name__} returned {len(result.grad_params)} "
                               f"parameter gradients for ops {[type(o).__name__ for o in st.ops]}")
        dy = result.grad_input
        if st.num_params:
            grad_params[st.params] = (_all_reduce_grads(result.grad_params, st.grad_sync)
                                      if st.grad_sync else result.grad_params)
        if len(result.grad_extra_inputs) != st.num_extra_in:
            raise RuntimeError(f"{type(op).__name__} returned {len(result.grad_extra_inputs)} "
                               f"extra-input gradients for ops "
                               f"{[type(o).__name__ for o in st.ops]}")
        if st.num_extra_in:
            grad_extras[st.extra_in] = result.grad_extra_inputs
            if ch is not None:
                _sum_into(sums, ch.in_names, st.extra_in, result.grad_extra_inputs)
        for c in op_ctxs:
            c.clear()
        # The next stage's backward_args may allocate (an FP8 weight cast): this stage's
        # inputs (the incoming gradient, saved activations) must be gone by then.
        del args, result
    if ch is not None:
        grad_extras = [grad_extras[j] for j in ch.caller_in]
    return (dy if plan.input_needs_grad else None), grad_extras, grad_params


def _run_dgrad(plan: ExecPlan, st, args, fmt, traced: bool):
    """A split stage's dgrad (its custom op when traced, which queues the wgrad record
    itself); the record its wgrad reads goes to the queue of deferred wgrads."""
    if traced:
        return custom_ops.call_dgrad(st, args, plan.quantized_results, plan.outer_dtype, fmt)
    result, record = st.dgrad(args)
    if fmt is not None and result.grad_input is not None:
        result.grad_input = to_format(result.grad_input, fmt)
    deferred.defer(st.target.token, record, compiled=False)
    return result


def _all_reduce_grads(grads, sync) -> tuple:
    """Parameter gradients of replicated parameters that saw split tokens, summed over
    their group (functional collectives: traced like any op when compiled)."""
    grads = list(grads)
    for k, tp in sync:
        if grads[k] is not None:
            grads[k] = parallel.all_reduce(grads[k], tp)
    return tuple(grads)


class _PipelineFunction(torch.autograd.Function):
    """A whole planned group as one autograd node."""

    @staticmethod
    def forward(fctx, plan: ExecPlan, traced: bool, x, *tensors):
        extras_end = plan.num_extra_inputs
        params_end = extras_end + plan.num_params
        extra_inputs, params = tensors[:extras_end], tensors[extras_end:params_end]
        # main_grad buffers: held as they are (no version check: other groups add into
        # them between this forward and its backward, e.g. microbatches); FP8 scaling
        # states, which the stages update
        main_end = params_end + len(plan.main_grad_params)
        main_grads, states = tensors[params_end:main_end], tensors[main_end:]
        ctxs = [OperationContext(n, plan.recipe) for n in plan.needs]
        assign_states(plan, ctxs, states)
        y, extra_outputs = run_forward(plan, x, params, extra_inputs, ctxs, save=True,
                                       traced=traced)
        if plan.in_place_extra_inputs:  # written in place, and the output itself
            written = [extra_inputs[j] for j in plan.in_place_extra_inputs]
            if y is not written[-1]:
                raise RuntimeError(f"{plan.in_place_ops[-1].describe()}'s stage did not return "
                                   f"its extra input as the output")
            fctx.mark_dirty(*written)
        stash_saved(fctx, ctxs, plan.saved_readers, (x, *tensors[:params_end]),
                    (y, *extra_outputs))
        # Traced (compiled) runs keep the plan and ops weakly: a trace may keep this node alive
        # after the module is gone (dynamo's fake propagation never runs its backward), and
        # the compiled graph does not use the node at run time.
        shapes = [p.shape for p in params]  # what each parameter gradient must match
        held = shapes, main_grads, len(states)
        if traced:
            fctx.fusible = weakref.ref(plan), ctxs, traced, (), held
        else:
            fctx.fusible = plan, ctxs, traced, _anchors(plan), held
        if plan.constant_extra_outputs:
            fctx.mark_non_differentiable(*(extra_outputs[j] for j in plan.constant_extra_outputs))
        return (y, *extra_outputs) if extra_outputs else y

    @staticmethod
    def backward(fctx, grad_output, *grad_extra_outputs):
        if torch.is_grad_enabled():
            raise RuntimeError("fusible pipelines are differentiable once: double backward "
                               "(create_graph=True) is not supported, since saved "
                               "intermediates carry no autograd history")
        if fctx.fusible is None:
            raise RuntimeError("fusible frees saved intermediates during the backward pass: "
                               "backward through the same graph twice (retain_graph=True) is "
                               "not supported; run the forward again")
        plan, ctxs, traced, _, (shapes, main_grads, num_states) = fctx.fusible
        plan = plan() if traced else plan
        # Consumed: backward runs once, and the node (which traces may keep) holds nothing.
        fctx.fusible = None
        ctxs = restore_saved(fctx, ctxs, plan.ops)
        dx, grad_extras, grad_params = run_backward(plan, grad_output, grad_extra_outputs, ctxs,
                                                    traced)
        for g, shape in zip(grad_params, shapes):
            if g is not None and g.shape != shape:
                _wrong_grad_shape(plan, grad_params, shapes)
        if main_grads:
            _into_main_grads(plan, grad_params, main_grads, traced)
        return (None, None, dx, *grad_extras, *grad_params,
                *(None,) * (len(main_grads) + num_states))


def _into_main_grads(plan, grad_params: list, main_grads: tuple, traced: bool) -> None:
    """Add the float32 gradients of the plan's main-grad parameters into their buffers;
    autograd gets None for them, or, eagerly, where Megatron's DDP marks the parameter
    (``grad_added_to_main_grad``), the flag set and a dummy gradient for its hooks."""
    for k, buffer, (op, name) in zip(plan.main_grad_params, main_grads, plan.main_grad_owners):
        g = grad_params[k]
        if g is None:
            continue
        if g.dtype != torch.float32:
            raise RuntimeError(f"the backward stage covering {op.describe()} returned a {g.dtype} "
                               f"gradient for its {name}, which accumulates into main_grad: "
                               f"compute it in float32 (gemm_backward_args(..., "
                               f"linear.wgrad_dtype))")
        buffer.add_(g)
        grad_params[k] = None if traced else _megatron_dummy(op.param(name))


def _megatron_dummy(param):
    """None, or for a parameter Megatron's DDP tracks, its flag set and a dummy gradient
    (zeros with ``zero_out_wgrad``)."""
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    make = torch.zeros_like if getattr(param, "zero_out_wgrad", False) else torch.empty_like
    return make(param, memory_format=torch.contiguous_format)


def _wrong_grad_shape(plan, grad_params, shapes) -> None:
    """Raise naming the stage and the parameter whose gradient has another shape than the
    parameter (autograd would sum it down to the parameter's shape silently)."""
    for st in plan.backward:
        owners = [(op, name) for op in st.ops for name in op.param_names]
        for k, (op, name) in zip(range(st.params.start, st.params.stop), owners):
            g = grad_params[k]
            if g is not None and g.shape != shapes[k]:
                raise RuntimeError(f"{st.op.__class__.__name__} returned a gradient of shape "
                                   f"{tuple(g.shape)} for {op.describe()}'s {name}, whose "
                                   f"shape is {tuple(shapes[k])}")


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
    the extra inputs, the parameters, the main_grad buffers and the scaling states."""
    # Traced runs come from the compiled path (dynamo, AOTAutograd); eager runs are never
    # reached while dynamo traces (it traces fusible.runtime.compiled instead).
    if traced or torch._C._are_functorch_transforms_active():
        return _PipelineFunction.apply(plan, traced, *tensors)
    return _cpp_apply(plan, traced, *tensors)
