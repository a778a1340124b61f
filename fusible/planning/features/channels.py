"""The named-channels feature's planning pass: a ``MakeExtraOutput(channel=name)`` hands
its tensor to the ``AddExtraInput(channel=name)`` ops after it in the same group (an
internal residual, a fan-out) instead of to the caller, and the readers' gradients flow
back to it.

The planner and the executor keep working on the ops' own extra-input and extra-output
slots (one each per AddExtraInput and MakeExtraOutput); :class:`Channels` says which of
those slots the caller fills or receives and which a channel does
(``runtime/features/channels.py`` moves the tensors).
"""

from __future__ import annotations

from typing import Optional

import attrs

from fusible.planning.exec_plan import Preparation


@attrs.frozen
class Channels:
    """Per op-level extra input / output slot, its channel name (None: the caller's)."""

    in_names: tuple
    out_names: tuple
    caller_in: tuple   # the input slots the caller fills, in order
    caller_out: tuple  # the output slots returned to the caller, in order

    @property
    def any(self) -> bool:
        return any(self.in_names) or any(self.out_names)


def channel_of(op):
    """The channel an op's extra inputs read (its ``channel``), None: the caller's."""
    return getattr(op, "channel", None)


def write_channel_of(op):
    """The channel an op's extra outputs write: its ``write_channel`` where it has one
    (``ResumeFromChannel`` reads one channel and writes another), else its ``channel``."""
    return getattr(op, "write_channel", None) or channel_of(op)


def caller_counts(ops) -> tuple:
    """``(extra inputs, extra outputs)`` a caller of ``ops`` passes and receives."""
    return (sum(op.num_extra_inputs for op in ops if not channel_of(op)),
            sum(op.num_extra_outputs for op in ops if not write_channel_of(op)))


def channels_of(ops) -> Channels:
    """The channels of a group of ops, checked: one writer per name, readers after it, no
    writer without a reader. Raises ValueError naming the op."""
    in_names, out_names, read = [], [], set()
    written: dict[str, str] = {}  # channel -> its writer's label
    for i, op in enumerate(ops):
        name = write_channel_of(op)
        if channel_of(op) is not None and op.num_extra_inputs and getattr(op, "in_place", False):
            raise ValueError(f"{op.describe()} at [{i}]: in_place and channel do not combine")
        for _ in range(op.num_extra_outputs):
            if name is not None and name in written:
                raise ValueError(f"{op.describe()} at [{i}] writes channel {name!r}, which "
                                 f"{written[name]} writes already")
            if name is not None:
                written[name] = f"{ops[i].describe()} at [{i}]"
            out_names.append(name)
        name = channel_of(op)
        for _ in range(op.num_extra_inputs):
            if name is not None and name not in written:
                raise ValueError(f"{op.describe()} at [{i}] reads channel {name!r}, which no "
                                 f"MakeExtraOutput before it in the same group writes (a "
                                 f"channel lives within one Sequential's run of fusible ops)")
            read.add(name)
            in_names.append(name)
    unread = [n for n in written if n not in read]
    if unread:
        raise ValueError(f"{written[unread[0]]} writes channel {unread[0]!r}, which no "
                         f"AddExtraInput after it in the same group reads (a channel lives "
                         f"within one Sequential's run of fusible ops)")
    return Channels(tuple(in_names), tuple(out_names),
                    tuple(j for j, n in enumerate(in_names) if n is None),
                    tuple(j for j, n in enumerate(out_names) if n is None))


def attach(prep: Preparation, attached: dict) -> Optional[Channels]:
    """The group's channels, checked (None: every extra tensor is the caller's)."""
    channels = channels_of(prep.ops)
    if not channels.any:
        return None
    _check_channel_stages(prep.forward + prep.backward)
    return channels


def caller_slots(ops, channels: Optional[Channels]) -> tuple:
    """``(extra-input slots the caller fills, extra-output slots it receives)`` of a group
    of ``ops``: every slot without channels."""
    if channels is not None:
        return channels.caller_in, channels.caller_out
    return (tuple(range(sum(op.num_extra_inputs for op in ops))),
            tuple(range(sum(op.num_extra_outputs for op in ops))))


def _check_channel_stages(stages) -> None:
    """A stage may not cover both the writer and a reader of a channel: the executor
    passes channels between stages, never inside one."""
    for st in stages:
        written = {write_channel_of(op) for op in st.ops if op.num_extra_outputs} - {None}
        read = {channel_of(op) for op in st.ops if op.num_extra_inputs} - {None}
        if written & read:
            raise ValueError(f"the stage {st.provenance} covers both the writer and a reader of "
                             f"channel {sorted(written & read)[0]!r}: a fusion cannot pass a "
                             f"channel on inside itself")
