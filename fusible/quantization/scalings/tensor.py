"""One scale per tensor (current scaling): the data and its transposed copy share it."""

from __future__ import annotations

from typing import ClassVar

import attrs

from fusible.kernels import fp8_cast
from fusible.quantization.casts.tensorwise import cast_tensorwise, tensor_amax
from fusible.quantization.scalings.base import Scaling


@attrs.frozen
class TensorScaling(Scaling):
    """One scale per tensor (and its transposed copy)."""

    name: ClassVar[str] = "tensorwise"
    kernel_cast: ClassVar[bool] = True
    per_tensor: ClassVar[bool] = True

    def cast(self, x2, fp8_dtype, rowwise=True, columnwise=False, state=None):
        out = cast_tensorwise(x2, fp8_dtype, columnwise, rowwise=rowwise)
        if not rowwise:
            return [None, None, out[0], out[1]]
        return [out[0], out[1], out[2] if columnwise else None, None]

    def describes(self, data, scale_inv):
        return scale_inv.dim() == 0

    def cast_gathered(self, x2, fp8_dtype, columnwise, gather, max_over_group, state=None):
        # One scale for the group: the maxima over the ranks, then each rank's cast with it
        amax = max_over_group(tensor_amax(x2))  # 0 for no tokens
        data, scale_inv = cast_tensorwise(x2, fp8_dtype, False, amax)[:2]
        data = gather(data)
        copy = fp8_cast.transposed_copy(data) if columnwise else None
        return [data, scale_inv, copy, None]
