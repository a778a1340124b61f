"""The split backward at run time (:func:`fusible.split_backward`): a split stage runs its
dgrad in the backward pass and queues the record its wgrad reads
(``runtime/deferred.py``; ``runtime/wgrad.py`` runs the queue). Compiled, the dgrad
custom op queues the record itself, so it never crosses the graph
(``planning/features/split_backward.py`` plans the lanes)."""

from __future__ import annotations

import threading

import attrs

from fusible.core.lanes import splitting
from fusible.quantization.format import to_format
from fusible.runtime import custom_ops, deferred, wgrad
from fusible.runtime.compile_reasons import compile_reason
from fusible.runtime.executor import Call
from fusible.runtime.features.base import RuntimeFeature, StageHooks


def _check_pending(runner) -> None:
    """No eager forward outside split_backward() while deferred wgrads wait."""
    if deferred.waiting(threading.get_ident()) and not splitting():
        wgrad.check_forward(runner.name())


class SplitBackwardRuntime(RuntimeFeature):
    name = "split_backward"
    guard = staticmethod(_check_pending)

    def planned(self, record, plan):
        """The lane's stages marked with why they (or their dgrad stage) cannot compile;
        the optimizer-step check installed with the first split plan."""
        if record.lane:
            wgrad.install_step_check()
        lane = tuple(_marked(stage) for stage in record.lane)
        features = attrs.evolve(plan.features, split_backward=attrs.evolve(record, lane=lane))
        return attrs.evolve(plan, features=features)

    def stage_hooks(self, splits, st, direction: str):
        split = splits.of(st.lo) if direction == "backward" else None
        if split is None:
            return None

        def compute(call: Call, st, args):
            plan, fmt = call.plan, st.output_format
            if call.traced:
                return custom_ops.call_dgrad(st, split, args, plan.quantized_results,
                                             plan.outer_dtype, fmt)
            result, record = split.dgrad(args)
            if fmt is not None and result.grad_input is not None:
                result.grad_input = to_format(result.grad_input, fmt)
            deferred.defer(split.target.token, record, compiled=False, owner=call.owner)
            return result
        return StageHooks(compute=compute)


FEATURE = SplitBackwardRuntime()


def _marked(stage):
    """A wgrad-lane stage with why it, or its dgrad stage (the other custom op), cannot
    compile."""
    reason = compile_reason(stage) or custom_ops.unsupported_reason(stage.op.__class__,
                                                                    "dgrad")
    return stage if reason is None else attrs.evolve(stage, compile_reason=reason)
