"""The in-place extra inputs feature's planning pass: ``AddExtraInput(in_place=True)`` adds
into its extra input, which becomes the group's output (``runtime/features/in_place.py``
checks the tensor and tells autograd)."""

from __future__ import annotations

from typing import Optional

import attrs

from fusible.planning.exec_plan import Preparation
from fusible.planning.features.channels import channel_of


@attrs.frozen
class InPlaceExtras:
    """The caller's extra inputs written in place (indices among them), and their ops."""

    extra_inputs: tuple
    ops: tuple


def attach(prep: Preparation, attached: dict) -> Optional[InPlaceExtras]:
    """The extra inputs the group writes in place, or None. Each writer must be the
    group's last op: its output is that extra input, which autograd must see returned
    as the group's output."""
    found, position = [], 0  # position: among the extra inputs the caller passes
    ops = prep.ops
    for i, op in enumerate(ops):
        if channel_of(op):  # a channel's reader takes none of the caller's
            continue
        if op.num_extra_inputs and getattr(op, "in_place", False):
            if i != len(ops) - 1:
                raise ValueError(f"{op.describe()} at [{i}] writes the sum into its extra "
                                 f"input, which becomes the output: it must be the last op "
                                 f"of its Sequential; put the ops after it in another one")
            found.append((position, op))
        position += op.num_extra_inputs
    if not found:
        return None
    return InPlaceExtras(tuple(j for j, _ in found), tuple(op for _, op in found))
