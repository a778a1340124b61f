"""Gradient all-reduces at run time: after a backward stage, the gradients of its
replicated parameters that saw split tokens are summed over their group (functional
collectives: traced like any op when compiled; ``planning/features/grad_reduction.py``)."""

from __future__ import annotations

from fusible.functional import parallel
from fusible.runtime.features.base import RuntimeFeature, StageHooks


class GradReductionRuntime(RuntimeFeature):
    name = "grad_reduction"

    def stage_hooks(self, record, st, direction: str):
        sync = record.of(st.lo) if direction == "backward" else ()
        if not sync:
            return None

        def after(call, st, result) -> None:
            result.grad_params = all_reduce_grads(result.grad_params, sync)
        return StageHooks(after=(after,))


FEATURE = GradReductionRuntime()


def all_reduce_grads(grads, sync: tuple) -> tuple:
    """``grads`` with each ``(index, group)`` of ``sync`` summed over its group."""
    grads = list(grads)
    for k, group in sync:
        if grads[k] is not None:
            grads[k] = parallel.all_reduce(grads[k], group)
    return tuple(grads)
