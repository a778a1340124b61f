"""Profiler ranges around eager stages (``planning/features/stage_ranges.py``). A stage that
raises leaves its range open until the pass's record of it is freed (the profiler's
RecordFunction ends when it is destroyed), as an exception inside a ``with
record_function`` block would not: a debugging aid, not a guarantee."""

from __future__ import annotations

import torch

from fusible.runtime.executor import Call
from fusible.runtime.features.base import RuntimeFeature, StageHooks


class StageRangesRuntime(RuntimeFeature):
    name = "stage_ranges"
    uses_store = True

    def stage_hooks(self, record, st, direction: str):
        label = dict(record.forward if direction == "forward" else record.backward)[st.lo]
        key = ("stage_ranges", st.lo)

        def before(call: Call, st) -> None:
            if not call.traced:
                call.store[key] = span = torch.autograd.profiler.record_function(label)
                span.__enter__()

        def after(call: Call, st, result) -> None:
            span = call.store.pop(key, None)
            if span is not None:
                span.__exit__(None, None, None)
        return StageHooks(before=(before,), after=(after,))


FEATURE = StageRangesRuntime()
