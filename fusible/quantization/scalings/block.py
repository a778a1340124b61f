"""One scale per block: ``1 x group`` tiles of each row or ``group x group`` blocks,
float32 (DeepSeek-V3's blockwise scaling) or powers of two (MX)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from fusible.quantization.casts.blocks import E8M0, cast_blocks
from fusible.quantization.gemm import native_blockwise_gemm
from fusible.quantization.scalings.base import Scaling, gather_columns


@attrs.frozen
class BlockScaling(Scaling):
    """One scale per ``1 x group`` tile of each row (``square``: per ``group x group``
    block), the transposed copy tiled along its own rows (square: the same blocks);
    ``power2``: E8M0 scales, powers of two (MX)."""

    group: int = 128
    square: bool = False
    power2: bool = False

    def cast(self, x2, fp8_dtype, rowwise=True, columnwise=False, state=None):
        return cast_blocks(x2, fp8_dtype, self.group, self.square, self.power2, rowwise,
                           columnwise)

    def describes(self, data, scale_inv):
        if data.dim() != 2 or scale_inv.dim() != 2:
            return False
        if (scale_inv.dtype == E8M0) != self.power2:
            return False
        rows, cols = data.shape
        want_rows = -(-rows // self.group) if self.square else rows
        return tuple(scale_inv.shape) == (want_rows, -(-cols // self.group))

    def cast_gathered(self, x2, fp8_dtype, columnwise, gather, max_over_group, state=None):
        # Tiles along the rows are each rank's own; the copy's tiles (``group`` tokens) too
        # where every rank holds whole tiles of tokens.
        if self.square:
            raise NotImplementedError(f"an FP8 all-gather of {self.name} blocks is not "
                                      f"implemented")
        if columnwise and x2.shape[0] % self.group:
            raise NotImplementedError(
                f"an FP8 all-gather under {self.name} scaling needs every rank's tokens in "
                f"whole {self.group}-token tiles (the transposed copy's), got "
                f"{x2.shape[0]} tokens on this rank")
        data, scale_inv, t, t_scale_inv = self.cast(x2, fp8_dtype, True, columnwise)
        return [gather(data), gather(scale_inv), gather_columns(t, gather) if columnwise
                else None, gather_columns(t_scale_inv, gather) if columnwise else None]

    def emulated_on(self, device):
        return not (self.group == 128 and not self.power2 and native_blockwise_gemm(device))


@attrs.frozen
class Tile1x128Scaling(BlockScaling):
    name: ClassVar[str] = "blockwise_1x128"


@attrs.frozen
class Block128x128Scaling(BlockScaling):
    name: ClassVar[str] = "blockwise_128x128"
    square: bool = True


@attrs.frozen
class MX1x32Scaling(BlockScaling):
    name: ClassVar[str] = "mx_1x32"
    group: int = 32
    power2: bool = True
