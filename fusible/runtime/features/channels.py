"""Named channels at run time: a channel's tensor goes from its writer's extra-output slot
to its readers' extra-input slots, and the readers' gradients, summed, back to the
writer's (``planning/features/channels.py`` plans them)."""

from __future__ import annotations

from fusible.runtime.executor import Call
from fusible.runtime.features.base import RuntimeFeature, StageHooks


class ChannelsRuntime(RuntimeFeature):
    """Each pass works on the ops' own slots: the caller's extras are spread into them
    first, and the caller's results picked from them last."""

    name = "channels"
    uses_store = True

    def begin_forward(self, ch, call: Call) -> None:
        call.extras = _spread(call.extras, ch.caller_in, len(ch.in_names))  # store: name ->
        # the channel's tensor

    def end_forward(self, ch, call: Call) -> None:
        call.outputs = [call.outputs[j] for j in ch.caller_out]

    def begin_backward(self, ch, call: Call) -> None:
        call.extras = _spread(call.extras, ch.caller_out, len(ch.out_names))
        call.outputs = [None] * len(ch.in_names)  # store: name -> its readers' gradients,
        # summed so far

    def end_backward(self, ch, call: Call) -> None:
        call.outputs = [call.outputs[j] for j in ch.caller_in]

    def stage_hooks(self, ch, st, direction: str):
        reads = _named(ch.in_names, st.extra_in)
        writes = _named(ch.out_names, st.extra_out)
        if not (reads or writes):
            return None
        if direction == "forward":
            return StageHooks(before=(_take_tensors(ch, reads),) if reads else (),
                              after=(_keep_tensors(ch, writes),) if writes else ())
        return StageHooks(before=(_take_sums(ch, writes),) if writes else (),
                          after=(_add_grads(ch, reads),) if reads else ())


FEATURE = ChannelsRuntime()


def _named(names: tuple, span: slice) -> tuple:
    """The slots of ``span`` that a channel fills."""
    return tuple(slot for slot in range(span.start, span.stop) if names[slot] is not None)


def _spread(values, slots: tuple, n: int) -> list:
    """``n`` slots, ``values`` at ``slots`` (the caller's), None elsewhere (channels')."""
    out: list = [None] * n
    for value, slot in zip(values, slots):
        out[slot] = value
    return out


def _take_tensors(ch, slots: tuple):
    """Fill a reader's slots with its channels' tensors."""
    def before(call: Call, st) -> None:
        for slot in slots:
            name = ch.in_names[slot]
            if name not in call.store:
                raise RuntimeError(f"the stage {st.provenance} reads channel {name!r} before "
                                   f"its writer has run (a fusion covering both cannot pass "
                                   f"it on)")
            call.extras[slot] = call.store[name]
    return before


def _keep_tensors(ch, slots: tuple):
    """Keep the tensors a writer's stage produced on its channel slots."""
    def after(call: Call, st, result) -> None:
        for slot in slots:
            call.store[ch.out_names[slot]] = result.extra_outputs[slot - st.extra_out.start]
    return after


def _take_sums(ch, slots: tuple):
    """Give a writer's stage its channels' gradients: the readers' sum (None: no reader
    needed one)."""
    def before(call: Call, st) -> None:
        for slot in slots:
            call.extras[slot] = call.store.get(ch.out_names[slot])
    return before


def _add_grads(ch, slots: tuple):
    """Add a reader's gradients on its channel slots to their channels' sums."""
    def after(call: Call, st, result) -> None:
        for slot in slots:
            g = result.grad_extra_inputs[slot - st.extra_in.start]
            name = ch.in_names[slot]
            if g is not None:
                call.store[name] = g if call.store.get(name) is None else call.store[name] + g
    return after
