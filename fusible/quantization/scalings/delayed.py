"""Delayed scaling, as TransformerEngine's ``DelayedScaling``: a tensor is cast with the
scale that its role's earlier amaxes give, and its own amax joins that history in the
same pass. No pass over a tensor for its amax before the cast, so every cast reads its
tensor once (current scaling reads it twice, or recomputes a producer's values twice).

The scaling (:class:`DelayedTensorScaling`, one scale per tensor) is stateful: each op
keeps one state per tensor role (a linear layer's input, weight and output gradient)
as a buffer, zeros at first (scale 1: the first step's values are not yet known), and
the formats carry it to the casts (``Float8Format.state``); the state's layout and its
update are :mod:`fusible.kernels.fp8_delayed`'s, the cast
:func:`~fusible.quantization.casts.delayed.cast_delayed`. The recipe that picks it is
:class:`~fusible.quantization.recipes.delayed.DelayedScaling`.
"""

from __future__ import annotations

import functools
from typing import ClassVar, Optional

import attrs
import torch

from fusible.kernels import fp8_cast
from fusible.kernels.fp8_delayed import DelayedCast
from fusible.quantization.casts.delayed import cast_delayed
from fusible.quantization.scalings.base import Scaling, register_scaling

_c10d = torch.ops._c10d_functional


@attrs.frozen
class DelayedTensorScaling(Scaling):
    """One scale per tensor, from the amaxes its role recorded in its ``history`` last
    casts (their maximum, or the newest with ``most_recent``), ``2 ** margin`` smaller;
    each cast records its tensor's amax, reduced over the process group named ``group``
    first where given. Its name says its parameters (``"delayed_max16"``, ...)."""

    history: int
    most_recent: bool = False
    margin: int = 0
    group: str = ""

    kernel_cast: ClassVar[bool] = True
    per_tensor: ClassVar[bool] = True
    stateful: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return (f"delayed_{'latest' if self.most_recent else 'max'}{self.history}"
                + (f"_margin{self.margin}" if self.margin else "")
                + (f"_group{self.group}" if self.group else ""))

    @property
    def state_size(self) -> int:
        return 2 + self.history

    def describes(self, data, scale_inv):
        return scale_inv.dim() == 0

    def delayed(self, state: Optional[torch.Tensor], reduce=None) -> DelayedCast:
        """The kernels' view of one cast with ``state``; ``reduce``: a maximum over
        another group (tensor parallelism's) before this scaling's own."""
        if state is None:
            raise ValueError(f"an FP8 cast under {self.name} scaling needs its role's state "
                             f"(a Float8Format bound to it); none was given")
        own = _max_over(self.group)
        if reduce is not None and own is not None:
            return DelayedCast(state, self.most_recent, self.margin, lambda t: own(reduce(t)))
        return DelayedCast(state, self.most_recent, self.margin, reduce or own)

    def cast(self, x2, fp8_dtype, rowwise=True, columnwise=False, state=None):
        if not rowwise:
            raise ValueError(f"a {self.name} cast keeps the data: its scale and amax are "
                             f"those of the step's one cast of the tensor")
        parts = cast_delayed(x2, fp8_dtype, columnwise, self.delayed(state))
        return [parts[0], parts[1], parts[2] if columnwise else None, None]

    def cast_gathered(self, x2, fp8_dtype, columnwise, gather, max_over_group, state=None):
        # The ranks' states are equal (their amaxes always reduced over the group): the
        # same scale on every rank, and each casts its own rows.
        data, scale_inv = cast_delayed(x2, fp8_dtype, False,
                                       self.delayed(state, max_over_group))[:2]
        data = gather(data)
        return [data, scale_inv, fp8_cast.transposed_copy(data) if columnwise else None, None]


def _max_over(group: str):
    """``t -> t``: the elementwise maximum over the process group named ``group``, or None."""
    if not group:
        return None
    return lambda t: _c10d.wait_tensor(_c10d.all_reduce(t.contiguous(), "max", group))


@functools.lru_cache(maxsize=None)
def delayed_scaling(history: int, most_recent: bool, margin: int, group: str
                    ) -> DelayedTensorScaling:
    """The registered scaling of these parameters (registered on first use)."""
    return register_scaling(DelayedTensorScaling(history, most_recent, margin, group))
