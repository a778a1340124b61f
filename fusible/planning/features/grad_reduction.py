"""The gradient all-reduce feature's planning pass: replicated parameters that see tokens
split over a group (``op.grad_reduction()``: sequence parallelism) have their gradients
summed over it after their backward stage (``runtime/features/grad_reduction.py``)."""

from __future__ import annotations

from typing import Optional

import attrs

from fusible.planning.exec_plan import Preparation


@attrs.frozen
class GradReduction:
    """Per backward stage (by its ``lo``): ``((parameter index in the stage, group),
    ...)`` of the gradients to all-reduce."""

    stages: tuple  # ((lo, ((k, group), ...)), ...)

    def of(self, lo: int) -> tuple:
        """The all-reduces of the backward stage at ``lo`` (empty: none)."""
        return dict(self.stages).get(lo, ())


def attach(prep: Preparation, attached: dict) -> Optional[GradReduction]:
    found = []
    for st in prep.backward:
        sync, offset = [], 0
        for op in st.ops:
            group = op.grad_reduction()
            if group is not None:
                sync += [(offset + k, group) for k in range(len(op.param_names))]
            offset += len(op.param_names)
        if sync:
            found.append((st.lo, tuple(sync)))
    return GradReduction(tuple(found)) if found else None
