"""Scalings: what one FP8 scale covers, the plugin point behind a format's ``granularity``.

A :class:`Scaling` casts a 2-D (rows, features) tensor into FP8 data with its scales
and, where a GEMM contracting over the rows needs it, the transposed copy with the
copy's own scales; it says whether the producers' fused casts write it
(``kernel_cast``: per-tensor scales only) and whether the GEMMs it feeds run natively
on a device or emulated. Scales are stored so that the shapes say which block each
covers (:func:`fusible.quantization.cast.scale_blocks`): a Float8Tensor dequantizes,
views and transposes whatever its scaling. A recipe picks scalings by name in its
formats; a new one registers with :func:`register_scaling`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, TypeVar

import attrs
import torch

from fusible.kernels import fp8_cast
from fusible.quantization import block_cast, cast
from fusible.quantization.gemm import native_blockwise_gemm, native_rowwise_gemm

_scalings: dict = {}  # name -> Scaling


@attrs.frozen
class Scaling:
    """Base of scalings (a subclass registers an instance with :func:`register_scaling`).

    Attributes
    ----------
    name : str
        The registry's name, what ``Float8Format.granularity`` holds.
    kernel_cast : bool
        Whether the norm and activation kernels' fused casts (one scale per tensor)
        write this scaling; otherwise those stages hand over high precision and the
        cast follows them in the same stage.
    per_tensor : bool
        One scale per tensor (0-d scales).
    stateful : bool
        The casts read and update a state tensor of their tensor role (one per op and
        role, kept by the op: ``state_size`` float32 values, zeros at first) that the
        format carries (``Float8Format.state``): delayed scaling's amax history.
    """

    if TYPE_CHECKING:  # read-only, for the type checker: a subclass may compute it
        @property
        def name(self) -> str: ...
    else:
        name: ClassVar[str] = ""
    kernel_cast: ClassVar[bool] = False
    per_tensor: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    @property
    def state_size(self) -> int:
        """The number of float32 values of a role's state (0: stateless)."""
        return 0

    def cast(self, x2: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = True,
             columnwise: bool = False, state=None) -> list:
        """``[data, scale_inv, transpose, transpose_scale_inv]`` of the 2-D ``x2``, None
        where not asked for; ``transpose`` is the row-major (features, rows) copy.
        ``state``: the role's state tensor of a stateful scaling (updated), else None."""
        raise NotImplementedError(f"{type(self).__name__}.cast")

    def describes(self, data: torch.Tensor, scale_inv: torch.Tensor) -> bool:
        """Whether ``scale_inv`` has the shape (and dtype) this scaling gives ``data``."""
        raise NotImplementedError(f"{type(self).__name__}.describes")

    def emulated_on(self, device: torch.device) -> bool:
        """Whether the GEMMs of this scaling run emulated on ``device`` (dequantized
        operands, a float32 GEMM) for want of a native kernel."""
        return False

    def cast_gathered(self, x2: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool,
                      gather, max_over_group, state=None) -> list:
        """``[data, scale_inv, transpose, transpose_scale_inv]`` of the rows of every rank
        concatenated (``gather(t)``: every rank's ``t`` along dim 0), each rank casting
        its own rows: the bits of casting the gathered tensor. ``max_over_group(t)``: the
        elementwise maximum over the ranks; ``state`` as in :meth:`cast`. Scalings whose
        scales span rows of several ranks raise NotImplementedError."""
        raise NotImplementedError(f"an FP8 all-gather under {self.name} scaling is not "
                                  f"implemented")


_S = TypeVar("_S", bound=Scaling)


def register_scaling(scaling: _S) -> _S:
    """Make ``scaling`` (an instance of a :class:`Scaling` subclass) a granularity that
    formats may name. Raises ValueError if another scaling holds its name."""
    if not (isinstance(scaling, Scaling) and scaling.name):
        raise TypeError(f"register_scaling: takes an instance of a named Scaling subclass, "
                        f"got {scaling!r}")
    known = _scalings.get(scaling.name)
    if known is not None and known != scaling:
        raise ValueError(f"register_scaling: the name {scaling.name!r} is taken by {known!r}")
    _scalings[scaling.name] = scaling
    return scaling


def scaling_named(name: str) -> Scaling:
    """The registered scaling ``name``; ValueError listing the known ones otherwise."""
    found = _scalings.get(name)
    if found is None:
        raise ValueError(f"no FP8 scaling named {name!r}; known: {', '.join(_scalings)}")
    return found


def registered_scalings() -> dict:
    """``{name: Scaling}``, in registration order."""
    return dict(_scalings)


def scaling_of(data: torch.Tensor, scale_inv: torch.Tensor) -> Scaling:
    """The first registered scaling that describes these scales (ValueError if none)."""
    found = next((s for s in _scalings.values() if s.describes(data, scale_inv)), None)
    if found is None:
        raise ValueError(f"no registered FP8 scaling gives data of shape {tuple(data.shape)} "
                         f"scales of shape {tuple(scale_inv.shape)} ({scale_inv.dtype})")
    return found


def _gather_columns(t: torch.Tensor, gather) -> torch.Tensor:
    """Every rank's (rows, columns) ``t`` concatenated along the columns (a gather along
    dim 0, then the ranks' blocks side by side)."""
    stacked = gather(t.contiguous())
    ranks = stacked.shape[0] // t.shape[0] if t.shape[0] else 1
    return stacked.view(ranks, *t.shape).permute(1, 0, 2).reshape(t.shape[0], -1)


@attrs.frozen
class TensorScaling(Scaling):
    """One scale per tensor (and its transposed copy)."""

    name: ClassVar[str] = "tensorwise"
    kernel_cast: ClassVar[bool] = True
    per_tensor: ClassVar[bool] = True

    def cast(self, x2, fp8_dtype, rowwise=True, columnwise=False, state=None):
        out = cast.cast_to_fp8_any(x2, fp8_dtype, columnwise, rowwise=rowwise)
        if not rowwise:
            return [None, None, out[0], out[1]]
        return [out[0], out[1], out[2] if columnwise else None, None]

    def describes(self, data, scale_inv):
        return scale_inv.dim() == 0

    def cast_gathered(self, x2, fp8_dtype, columnwise, gather, max_over_group, state=None):
        # One scale for the group: the maxima over the ranks, then each rank's cast with it
        amax = max_over_group(cast.tensor_amax(x2))  # 0 for no tokens
        data, scale_inv = cast.cast_to_fp8_any(x2, fp8_dtype, False, amax)[:2]
        data = gather(data)
        copy = fp8_cast.transposed_copy(data) if columnwise else None
        return [data, scale_inv, copy, None]


@attrs.frozen
class RowScaling(Scaling):
    """One scale per row; the transposed copy one per row of its own layout."""

    name: ClassVar[str] = "rowwise"

    def cast(self, x2, fp8_dtype, rowwise=True, columnwise=False, state=None):
        return cast.cast_to_fp8_rowwise(x2, fp8_dtype, rowwise, columnwise)

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
        data, scale_inv, t, t_scale_inv = cast.cast_to_fp8_rowwise(
            x2, fp8_dtype, True, columnwise, column_amax=column_amax)
        return [gather(data), gather(scale_inv),
                _gather_columns(t, gather) if columnwise else None, t_scale_inv]


@attrs.frozen
class BlockScaling(Scaling):
    """One scale per ``1 x group`` tile of each row (``square``: per ``group x group``
    block), the transposed copy tiled along its own rows (square: the same blocks);
    ``power2``: E8M0 scales, powers of two (MX)."""

    group: int = 128
    square: bool = False
    power2: bool = False

    def cast(self, x2, fp8_dtype, rowwise=True, columnwise=False, state=None):
        return block_cast.cast_to_fp8_blocks(x2, fp8_dtype, self.group, self.square,
                                             self.power2, rowwise, columnwise)

    def describes(self, data, scale_inv):
        if data.dim() != 2 or scale_inv.dim() != 2:
            return False
        if (scale_inv.dtype == block_cast.E8M0) != self.power2:
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
        return [gather(data), gather(scale_inv), _gather_columns(t, gather) if columnwise
                else None, _gather_columns(t_scale_inv, gather) if columnwise else None]

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


for _scaling in (TensorScaling(), RowScaling(), Tile1x128Scaling(), Block128x128Scaling(),
                 MX1x32Scaling()):
    register_scaling(_scaling)
