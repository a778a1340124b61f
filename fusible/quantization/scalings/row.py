"""One scale per row (row-wise current scaling); the transposed copy one per row of its
own layout."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from fusible.quantization.casts.rowwise import cast_rowwise
from fusible.quantization.gemm import native_rowwise_gemm
from fusible.quantization.scalings.base import Scaling, gather_columns


@attrs.frozen
class RowScaling(Scaling):
    """One scale per row; the transposed copy one per row of its own layout."""

    name: ClassVar[str] = "rowwise"

    def cast(self, x2, fp8_dtype, rowwise=True, columnwise=False, state=None):
        return cast_rowwise(x2, fp8_dtype, rowwise, columnwise)

    def describes(self, data, scale_inv):
        return (scale_inv.dtype == torch.float32 and scale_inv.dim() == data.dim()
                and scale_inv.shape[:-1] == data.shape[:-1] and scale_inv.shape[-1] == 1)

    def emulated_on(self, device):
        return not native_rowwise_gemm(torch.device(device).type)

    def cast_gathered(self, x2, fp8_dtype, columnwise, gather, max_over_group, state=None):
        # Rows: each rank's own. The copy's rows (features) span every rank's tokens: their
        # maxima over the group first, each rank casts its columns, the copies concatenate.
        column_amax = None
        if columnwise:
            local = (x2.abs().amax(0).float() if x2.shape[0]
                     else x2.new_zeros(x2.shape[1], dtype=torch.float32))
            column_amax = max_over_group(local)
        data, scale_inv, t, t_scale_inv = cast_rowwise(
            x2, fp8_dtype, True, columnwise, column_amax=column_amax)
        return [gather(data), gather(scale_inv),
                gather_columns(t, gather) if columnwise else None, t_scale_inv]
