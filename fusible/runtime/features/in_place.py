"""In-place extra inputs at run time: the tensor an op adds into must be contiguous (no
copy may stand in for it), and autograd is told it was written and is the output
(``planning/features/in_place.py`` finds the ops)."""

from __future__ import annotations

from fusible.runtime.executor import Call
from fusible.runtime.features.base import RuntimeFeature


class InPlaceRuntime(RuntimeFeature):
    name = "in_place"

    def begin_forward(self, record, call: Call) -> None:
        for j, op in zip(record.extra_inputs, record.ops):
            given = call.given[j]
            if not given.is_contiguous():  # the sum goes into it: no copy may stand in
                raise ValueError(f"{op.describe()} writes into its extra input, which must be "
                                 f"contiguous; got strides {given.stride()} for shape "
                                 f"{tuple(given.shape)}")
            if call.saves and given.is_leaf and given.requires_grad:
                raise ValueError(f"{op.describe()} writes into its extra input, a leaf tensor "
                                 f"that requires grad, which autograd forbids: pass a tensor "
                                 f"computed from it (or one that needs no grad), or make the "
                                 f"op with in_place=False")

    def forward_node(self, record, fctx, extra_inputs: tuple, output) -> None:
        written = [extra_inputs[j] for j in record.extra_inputs]
        if output is not written[-1]:
            raise RuntimeError(f"{record.ops[-1].describe()}'s stage did not return its extra "
                               f"input as the output")
        fctx.mark_dirty(*written)


FEATURE = InPlaceRuntime()
