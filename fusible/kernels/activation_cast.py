"""A pointwise activation writing its result in FP8 directly (one scale per tensor).

The next linear layer reads the activation's output in FP8. Instead of writing the
output in high precision and casting it (write, read for the amax, read for the cast),
a first pass computes the activation for its absolute maximum only, a second computes
it again and writes the FP8 data and its transposed copy: two reads of the input, one
write of FP8. The values are rounded to the input dtype before the amax and the cast,
as a high-precision output would be. Under delayed scaling the scale is known before
the values: one pass, which records their amax.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusible.kernels import jit, require_triton, tl
from fusible.kernels.fp8_cast import (atomic_amax_of_tile, fp8_buffers, fp8_results,
                                      scale_from_amax, store_fp8_tile, tile_coords, tile_grid)
from fusible.kernels.fp8_delayed import (DelayedCast, finish, kernel_args, record_delayed,
                                         scale_amax)

# The activations whose backward reads their input (ReLU's reads its output, which
# must then stay in high precision: it keeps the unfused path).
KINDS = {"gelu": 0, "gelu_tanh": 1, "silu": 3}


@jit
def _activation(x, KIND: tl.constexpr):
    if KIND == 0:  # exact GELU
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif KIND == 1:  # tanh GELU: (1 + tanh(u)) / 2 = sigmoid(2u)
        return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    else:  # SiLU
        return x * tl.sigmoid(x)


@jit
def _activation_tile(x_ptr, M, N, KIND: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """The rounded activation of this program's tile, in float32; rows, cols, mask."""
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    y = _activation(x, KIND).to(x_ptr.dtype.element_ty).to(tl.float32)
    return y, rows, cols, mask


@jit
def _activation_kernel(x_ptr, y_ptr, amax_ptr, M, N, KIND: tl.constexpr,
                       AMAX_ONLY: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """The activation's absolute maximum (``AMAX_ONLY``, the first FP8 pass), or the
    activation itself (the high-precision kernel the FP8 one is checked against)."""
    y, rows, cols, mask = _activation_tile(x_ptr, M, N, KIND, BLOCK_M, BLOCK_N)
    if AMAX_ONLY:
        atomic_amax_of_tile(y, mask, amax_ptr)
    else:
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _activation_cast_kernel(x_ptr, amax_ptr, data_ptr, t_ptr, scale_inv_ptr, M, N,
                            FP8_MAX, state_ptr, ticket_ptr, MARGIN_FACTOR,
                            KIND: tl.constexpr, HAS_T: tl.constexpr, DELAYED: tl.constexpr,
                            ROLL: tl.constexpr, MOST_RECENT: tl.constexpr,
                            HISTORY: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    scale = scale_from_amax(amax_ptr, FP8_MAX)
    y, rows, cols, mask = _activation_tile(x_ptr, M, N, KIND, BLOCK_M, BLOCK_N)
    store_fp8_tile(y, scale, rows, cols, mask, data_ptr, t_ptr, scale_inv_ptr, M, N,
                   FP8_MAX, HAS_T)
    if DELAYED:
        record_delayed(y, mask, state_ptr, ticket_ptr, MARGIN_FACTOR, ROLL, MOST_RECENT,
                       HISTORY, BLOCK_H)


def _rows_cols(name: str, kind: str, x: torch.Tensor) -> tuple:
    require_triton(name)
    if kind not in KINDS:
        raise ValueError(f"{name}: kind must be one of {list(KINDS)}, got {kind!r}")
    n = x.shape[-1] if x.dim() else 1
    return (x.numel() // n if n else 0), n


def activation_triton(kind: str, x: torch.Tensor, block_m: int = 64,
                      block_n: int = 128) -> torch.Tensor:
    """The activation ``kind`` of ``x`` in ``x``'s dtype, by the arithmetic of
    :func:`activation_fp8_triton` (which is this followed by the FP8 cast)."""
    m, n = _rows_cols("activation_triton", kind, x)
    x = x.contiguous()
    y = torch.empty_like(x)
    if m * n:
        _activation_kernel[tile_grid(m, n, block_m, block_n)](
            x, y, y, m, n, KIND=KINDS[kind], AMAX_ONLY=False, BLOCK_M=block_m,
            BLOCK_N=block_n)
    return y


def activation_fp8_triton(kind: str, x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                          columnwise: bool, delayed: Optional[DelayedCast] = None,
                          block_m: int = 32, block_n: int = 128) -> list:
    """``[data, scale_inv]`` (+ the transposed copy when ``columnwise``): the activation
    ``kind`` of ``x`` (a key of :data:`KINDS`) rounded to ``x``'s dtype, then cast to
    ``fp8_dtype`` (largest value ``fp8_max``) with a current per-tensor scale (two
    passes), or with ``delayed``'s, its amax recorded (one pass)."""
    m, n = _rows_cols("activation_fp8_triton", kind, x)
    if not m * n:
        raise ValueError(f"activation_fp8_triton: empty input {tuple(x.shape)}")
    x = x.contiguous()
    grid = tile_grid(m, n, block_m, block_n)
    amax = scale_amax(delayed, x.device, lambda slot: _activation_kernel[grid](
        x, slot, slot, m, n, KIND=KINDS[kind], AMAX_ONLY=True, BLOCK_M=block_m,
        BLOCK_N=block_n))
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(x, fp8_dtype, columnwise)
    _activation_cast_kernel[grid](x, amax, data, transpose, scale_inv, m, n, fp8_max,
                                  **kernel_args(delayed, amax), KIND=KINDS[kind],
                                  HAS_T=in_kernel_t, BLOCK_M=block_m, BLOCK_N=block_n)
    finish(delayed)
    return fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)
