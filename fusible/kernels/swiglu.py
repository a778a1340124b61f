"""SwiGLU and the other gated linear units (GLU, GEGLU, QGEGLU, ReGLU, SReGLU, and the
clamped SwiGLU of GPT-OSS), forward and backward, one pass over memory each, float32 in
registers only.

``x = [a | b]`` (each half ``N`` wide), ``y = gate(a) * b`` (``KINDS``: SwiGLU's gate is
``silu``). With an interleave size ``S`` the halves alternate in blocks of ``S``
(``[a_1..a_S, b_1..b_S, a_S+1..]``, TransformerEngine's ``glu_interleave_size``): the
kernels read and write them in place, no de-interleaved copy. The forward reads ``x``
once and writes ``y``; the backward reads ``dy`` and ``x`` once and writes both halves
of ``dx``. When the neighbouring GEMM takes the result in FP8 (forward: the next
linear layer's input; backward: the previous one's output gradient), the result is
never written in high precision: a first pass computes it for its absolute maximum,
a second computes it again and writes the FP8 data and its transposed copy. The
values are rounded to the input dtype before the amax and the cast, so the bits are
those of the plain kernel followed by the FP8 cast.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusible.kernels import jit, require_triton, tl
from fusible.kernels.fp8_cast import (atomic_amax_of_tile, fp8_buffers, fp8_results,
                                      scale_from_amax, store_fp8_tile, tile_coords, tile_grid)
from fusible.kernels.fp8_delayed import (DelayedCast, finish, kernel_args, record_delayed,
                                         scale_amax)


@jit
def _half_cols(cols, N, S, INTERLEAVED: tl.constexpr):
    """The columns of ``a`` and of ``b`` in a row of ``x`` (``2N`` wide) for the output
    columns ``cols``: halves one after the other, or alternating in blocks of ``S``."""
    if INTERLEAVED:
        a_cols = (cols // S) * (2 * S) + cols % S
        return a_cols, a_cols + S
    return cols, cols + N


@jit
def _swiglu_tile(x_ptr, rows, a_cols, b_cols, mask, N):
    """``(a, b)`` of the tile, float32."""
    row_offs = rows[:, None].to(tl.int64) * (2 * N)
    a = tl.load(x_ptr + row_offs + a_cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row_offs + b_cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return a, b


KINDS = {"swiglu": 0, "geglu": 1, "glu": 2, "reglu": 3, "sreglu": 4, "qgeglu": 5,
         "clamped_swiglu": 6, "situ_glu": 7}


@jit
def _gate(a, KIND: tl.constexpr):
    """``(gate(a), gate'(a))``."""
    if KIND == 1:  # tanh GELU; (1 + tanh u) / 2 = sigmoid(2u): no cancellation in the tails
        inner = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        sig = tl.sigmoid(2.0 * inner)
        return a * sig, sig + 2.0 * a * sig * (1.0 - sig) * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * a * a)
    elif KIND == 2:  # sigmoid; 1 - sigmoid(a) as sigmoid(-a): no cancellation for large a
        sig = tl.sigmoid(a)
        return sig, sig * tl.sigmoid(-a)
    elif KIND == 3:  # ReLU (NaN kept, as torch.relu keeps it)
        return tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL), tl.where(a > 0.0, 1.0, 0.0)
    elif KIND == 4:  # squared ReLU
        r = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)
        return r * r, 2.0 * r
    else:  # KIND 5, quick GELU: a * sigmoid(1.702 a)
        sig = tl.sigmoid(1.702 * a)
        return a * sig, sig + 1.702 * a * sig * (1.0 - sig)


@jit
def _clamped(a, b, LIMIT, ALPHA, OFFSET):
    """The clamped SwiGLU's ``(gate(a'), gate'(a'), b' + OFFSET)`` with ``a' = min(a,
    LIMIT)``, ``b' = clamp(b, -LIMIT, LIMIT)`` and ``gate(a) = a sigmoid(ALPHA a)``."""
    a = tl.minimum(a, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    b = tl.minimum(tl.maximum(b, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                   propagate_nan=tl.PropagateNan.ALL)
    sig = tl.sigmoid(ALPHA * a)
    return a * sig, sig + ALPHA * a * sig * (1.0 - sig), b + OFFSET


@jit
def _tanh(z):
    """tanh(z) as 2 sigmoid(2z) - 1, by its odd series where |z| < 1/8 (where the
    difference cancels): float32-accurate either side (the next term is ~1e-9)."""
    z2 = z * z
    series = z * (1.0 + z2 * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(z) < 0.125, series, 2.0 * tl.sigmoid(2.0 * z) - 1.0)


@jit
def _tanh_grad(z):
    """1 - tanh(z)^2 as 4 sigmoid(2z) sigmoid(-2z): no cancellation where tanh saturates."""
    return 4.0 * tl.sigmoid(2.0 * z) * tl.sigmoid(-2.0 * z)


@jit
def _situ(a, b, GATE_SCALE, LINEAR_SCALE, OFFSET):
    """SiTU-GLU's ``(gate(a), gate'(a), linear(b), linear'(b))``: ``gate(a) = s tanh(a/s)
    sigmoid(a)``, ``linear(b) = l tanh(b/l) + OFFSET`` (``b + OFFSET`` for ``l = 0``)."""
    z = a / GATE_SCALE
    sig = tl.sigmoid(a)
    gate = GATE_SCALE * _tanh(z) * sig
    gate_grad = _tanh_grad(z) * sig + gate * tl.sigmoid(-a)
    capped = LINEAR_SCALE != 0.0
    w = b / tl.where(capped, LINEAR_SCALE, 1.0)
    linear = tl.where(capped, LINEAR_SCALE * _tanh(w), b) + OFFSET
    return gate, gate_grad, linear, tl.where(capped, _tanh_grad(w), 1.0)


@jit
def _swiglu_values(a, b, LIMIT, ALPHA, OFFSET, KIND: tl.constexpr):
    if KIND == 0:
        return a * tl.sigmoid(a) * b
    if KIND == 6:
        g, _, lin = _clamped(a, b, LIMIT, ALPHA, OFFSET)
        return g * lin
    if KIND == 7:  # SiTU-GLU: LIMIT, ALPHA carry the gate's and the linear half's scales
        g, _, lin, _ = _situ(a, b, LIMIT, ALPHA, OFFSET)
        return g * lin
    g, _ = _gate(a, KIND)
    return g * b


@jit
def _swiglu_grads(dy, a, b, LIMIT, ALPHA, OFFSET, KIND: tl.constexpr):
    """``(da, db)``; for SwiGLU d silu(a) = sigmoid(a) (1 + a (1 - sigmoid(a))). The
    clamped kind passes no gradient where a clamp bit (``torch.clamp``'s rule: the
    bounds themselves pass)."""
    if KIND == 0:
        sig = tl.sigmoid(a)
        return dy * b * sig * (1.0 + a * (1.0 - sig)), dy * a * sig
    if KIND == 6:
        g, dg, lin = _clamped(a, b, LIMIT, ALPHA, OFFSET)
        da = tl.where(a <= LIMIT, dy * lin * dg, 0.0)
        db = tl.where((b >= -LIMIT) & (b <= LIMIT), dy * g, 0.0)
        return da, db
    if KIND == 7:
        g, dg, lin, dlin = _situ(a, b, LIMIT, ALPHA, OFFSET)
        return dy * lin * dg, dy * g * dlin
    g, dg = _gate(a, KIND)
    return dy * b * dg, dy * g


@jit
def _gated_tile(x_ptr, M, N, S, INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """This program's ``(rows, cols, mask, a_cols, b_cols, a, b)``: output coordinates,
    where the halves sit in ``x``, and their float32 values."""
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    a_cols, b_cols = _half_cols(cols, N, S, INTERLEAVED)
    a, b = _swiglu_tile(x_ptr, rows, a_cols, b_cols, mask, N)
    return rows, cols, mask, a_cols, b_cols, a, b


@jit
def _swiglu_fwd_kernel(x_ptr, y_ptr, amax_ptr, M, N, S, LIMIT, ALPHA, OFFSET,
                       KIND: tl.constexpr, INTERLEAVED: tl.constexpr, AMAX_ONLY: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``y`` (``M x N``), or (``AMAX_ONLY``) only the absolute maximum of its values."""
    rows, cols, mask, _, _, a, b = _gated_tile(x_ptr, M, N, S, INTERLEAVED, BLOCK_M, BLOCK_N)
    y = _swiglu_values(a, b, LIMIT, ALPHA, OFFSET, KIND).to(x_ptr.dtype.element_ty)
    if AMAX_ONLY:
        atomic_amax_of_tile(y.to(tl.float32), mask, amax_ptr)
    else:
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(y_ptr + offs, y, mask=mask)


@jit
def _swiglu_fwd_cast_kernel(x_ptr, amax_ptr, data_ptr, t_ptr, scale_inv_ptr, M, N, S,
                            LIMIT, ALPHA, OFFSET, FP8_MAX, state_ptr, ticket_ptr,
                            MARGIN_FACTOR, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
                            HAS_T: tl.constexpr, DELAYED: tl.constexpr, ROLL: tl.constexpr,
                            MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    scale = scale_from_amax(amax_ptr, FP8_MAX)
    rows, cols, mask, _, _, a, b = _gated_tile(x_ptr, M, N, S, INTERLEAVED, BLOCK_M, BLOCK_N)
    y = _swiglu_values(a, b, LIMIT, ALPHA, OFFSET, KIND).to(x_ptr.dtype.element_ty)
    store_fp8_tile(y.to(tl.float32), scale, rows, cols, mask, data_ptr, t_ptr,
                   scale_inv_ptr, M, N, FP8_MAX, HAS_T)
    if DELAYED:
        record_delayed(y.to(tl.float32), mask, state_ptr, ticket_ptr, MARGIN_FACTOR, ROLL,
                       MOST_RECENT, HISTORY, BLOCK_H)


@jit
def _gated_grads(dy_ptr, x_ptr, M, N, S, LIMIT, ALPHA, OFFSET, KIND: tl.constexpr,
                 INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(rows, cols, mask, a_cols, b_cols, a, b, da, db)``: :func:`_gated_tile`'s and
    the gradients rounded to ``dy``'s dtype."""
    rows, cols, mask, a_cols, b_cols, a, b = _gated_tile(x_ptr, M, N, S, INTERLEAVED,
                                                         BLOCK_M, BLOCK_N)
    dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    da, db = _swiglu_grads(dy, a, b, LIMIT, ALPHA, OFFSET, KIND)
    return (rows, cols, mask, a_cols, b_cols, a, b, da.to(dy_ptr.dtype.element_ty),
            db.to(dy_ptr.dtype.element_ty))


@jit
def halves_amax(da, db):
    """The elementwise absolute maximum of the gradient's two halves, float32 (NaN wins)."""
    return tl.maximum(tl.abs(da.to(tl.float32)), tl.abs(db.to(tl.float32)),
                      propagate_nan=tl.PropagateNan.ALL)


@jit
def _swiglu_bwd_kernel(dy_ptr, x_ptr, dx_ptr, amax_ptr, y_ptr, M, N, S, LIMIT, ALPHA, OFFSET,
                       KIND: tl.constexpr, INTERLEAVED: tl.constexpr, AMAX_ONLY: tl.constexpr,
                       WRITE_Y: tl.constexpr, DX_OVER_X: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """``dx`` (``M x 2N``), or (``AMAX_ONLY``) only the absolute maximum of its values;
    with ``WRITE_Y`` the forward's ``y`` too (``M x N``, the forward kernel's bits), from
    the same reads of ``x``, possibly over ``dy``, and ``dx`` over ``x`` with
    ``DX_OVER_X`` (each program writes only the tile it read, after a barrier: every
    thread of the program has read it by then)."""
    rows, cols, mask, a_cols, b_cols, a, b, da, db = _gated_grads(
        dy_ptr, x_ptr, M, N, S, LIMIT, ALPHA, OFFSET, KIND, INTERLEAVED, BLOCK_M, BLOCK_N)
    if AMAX_ONLY:
        atomic_amax_of_tile(halves_amax(da, db), mask, amax_ptr)
    else:
        if DX_OVER_X:
            tl.debug_barrier()
        row_offs = rows[:, None].to(tl.int64) * (2 * N)
        tl.store(dx_ptr + row_offs + a_cols[None, :], da, mask=mask)
        tl.store(dx_ptr + row_offs + b_cols[None, :], db, mask=mask)
    if WRITE_Y:
        y = _swiglu_values(a, b, LIMIT, ALPHA, OFFSET, KIND).to(x_ptr.dtype.element_ty)
        tl.debug_barrier()
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y, mask=mask)


@jit
def _swiglu_bwd_cast_kernel(dy_ptr, x_ptr, amax_ptr, data_ptr, t_ptr, scale_inv_ptr,
                            M, N, S, LIMIT, ALPHA, OFFSET, FP8_MAX, state_ptr, ticket_ptr,
                            MARGIN_FACTOR, KIND: tl.constexpr, INTERLEAVED: tl.constexpr,
                            HAS_T: tl.constexpr, DELAYED: tl.constexpr, ROLL: tl.constexpr,
                            MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    scale = scale_from_amax(amax_ptr, FP8_MAX)
    rows, _, mask, a_cols, b_cols, _, _, da, db = _gated_grads(
        dy_ptr, x_ptr, M, N, S, LIMIT, ALPHA, OFFSET, KIND, INTERLEAVED, BLOCK_M, BLOCK_N)
    # dx is M x 2N: the two halves are column tiles of it
    store_fp8_tile(da.to(tl.float32), scale, rows, a_cols, mask, data_ptr, t_ptr,
                   scale_inv_ptr, M, 2 * N, FP8_MAX, HAS_T)
    store_fp8_tile(db.to(tl.float32), scale, rows, b_cols, mask, data_ptr, t_ptr,
                   scale_inv_ptr, M, 2 * N, FP8_MAX, HAS_T)
    if DELAYED:
        record_delayed(halves_amax(da, db), mask, state_ptr, ticket_ptr, MARGIN_FACTOR, ROLL,
                       MOST_RECENT, HISTORY, BLOCK_H)


# GPT-OSS's clamped SwiGLU: (limit, alpha, linear offset), TransformerEngine's defaults
CLAMP_DEFAULTS = (7.0, 1.702, 1.0)


def check_halves(x: torch.Tensor, kind: str, interleave: int) -> None:
    """ValueError unless ``kind`` is a gated unit and ``x``'s last dimension splits into
    its halves (blocks of ``interleave``); the PyTorch path checks the same."""
    if kind not in KINDS:
        raise ValueError(f"gated kind must be one of {list(KINDS)}, got {kind!r}")
    width = 2 * interleave if interleave else 2
    if x.dim() == 0 or x.shape[-1] % width:
        raise ValueError(f"{kind} needs a last dimension divisible by {width}, got "
                         f"{tuple(x.shape)}")


def _rows_and_half(x: torch.Tensor, kind: str, interleave: int) -> tuple:
    check_halves(x, kind, interleave)
    n = x.shape[-1] // 2
    return (x.numel() // x.shape[-1] if x.shape[-1] else 0), n


def _layout(kind: str, interleave: int, clamp: tuple) -> dict:
    """The kernels' arguments that say which unit and where its halves are."""
    limit, alpha, offset = clamp
    return dict(S=interleave, LIMIT=float(limit), ALPHA=float(alpha), OFFSET=float(offset),
                KIND=KINDS[kind], INTERLEAVED=bool(interleave))


def swiglu_forward_triton(x: torch.Tensor, block_m: int = 32, block_n: int = 128,
                          kind: str = "swiglu", interleave: int = 0,
                          clamp: tuple = CLAMP_DEFAULTS, num_warps: int = 4):
    """``gate(a) * b`` for ``a, b = x.chunk(2, -1)`` (SwiGLU: ``silu(a) * b``), in ``x``'s
    dtype; ``interleave``: the halves alternate in blocks of that many columns (0: they
    do not); ``clamp``: the clamped kind's ``(limit, alpha, offset)``; ``num_warps`` per
    tile of ``block_m x block_n`` (diagnostics/bf16_kernel_tiles.py)."""
    require_triton("swiglu_forward_triton")
    x = x.contiguous()
    m, n = _rows_and_half(x, kind, interleave)
    y = x.new_empty((*x.shape[:-1], n))
    if y.numel():
        _swiglu_fwd_kernel[tile_grid(m, n, block_m, block_n)](
            x, y, y, m, n, **_layout(kind, interleave, clamp), AMAX_ONLY=False,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y


def swiglu_forward_fp8_triton(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                              columnwise: bool, delayed: Optional[DelayedCast] = None,
                              block_m: int = 32, block_n: int = 128, kind: str = "swiglu",
                              interleave: int = 0, clamp: tuple = CLAMP_DEFAULTS):
    """``[data, scale_inv]`` (+ the transposed copy when ``columnwise``) of the forward's
    result in ``fp8_dtype`` with a current per-tensor scale (two passes), or ``delayed``'s
    (one, recording the amax), as the FP8 cast of :func:`swiglu_forward_triton`'s result
    would give."""
    require_triton("swiglu_forward_fp8_triton")
    x = x.contiguous()
    m, n = _rows_and_half(x, kind, interleave)
    if not m * n:
        raise ValueError(f"swiglu_forward_fp8_triton: empty input {tuple(x.shape)}")
    grid = tile_grid(m, n, block_m, block_n)
    layout = _layout(kind, interleave, clamp)
    amax = scale_amax(delayed, x.device, lambda slot: _swiglu_fwd_kernel[grid](
        x, slot, slot, m, n, **layout, AMAX_ONLY=True, BLOCK_M=block_m, BLOCK_N=block_n))
    like = x.new_empty(()).expand(*x.shape[:-1], n)  # the result's shape, no memory
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(like, fp8_dtype, columnwise)
    _swiglu_fwd_cast_kernel[grid](x, amax, data, transpose, scale_inv, m, n,
                                  **layout, FP8_MAX=fp8_max, **kernel_args(delayed, amax),
                                  HAS_T=in_kernel_t, BLOCK_M=block_m, BLOCK_N=block_n)
    finish(delayed)
    return fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)


def swiglu_backward_triton(grad_output: torch.Tensor, x: torch.Tensor, block_m: int = 32,
                           block_n: int = 128, kind: str = "swiglu", interleave: int = 0,
                           clamp: tuple = CLAMP_DEFAULTS, with_output: bool = False,
                           consume_grad: bool = False, consume_input: bool = False,
                           num_warps: int = 4):
    """The gradient of :func:`swiglu_forward_triton` with respect to ``x``; with
    ``with_output``, ``(dx, y)``: the forward's result again, from the same pass (for a
    weight gradient that recomputes its input instead of saving it), written over
    ``grad_output`` where ``consume_grad`` and the dtypes agree (the caller reads it no
    more: one tensor of that size less at once); ``dx`` over ``x`` likewise where
    ``consume_input``, ``x`` is contiguous and the dtypes agree. Tiles as the forward's."""
    require_triton("swiglu_backward_triton")
    over_x = consume_input and x.is_contiguous() and grad_output.dtype == x.dtype
    dy, x = grad_output.contiguous(), x.contiguous()
    m, n = _rows_and_half(x, kind, interleave)
    dx = x if over_x else torch.empty_like(x, dtype=dy.dtype)
    if not with_output:
        y = dx
    elif consume_grad and dy.dtype == x.dtype:
        y = dy
    else:
        y = x.new_empty((*x.shape[:-1], n))
    if dx.numel():
        _swiglu_bwd_kernel[tile_grid(m, n, block_m, block_n)](
            dy, x, dx, dx, y, m, n, **_layout(kind, interleave, clamp), AMAX_ONLY=False,
            WRITE_Y=with_output, DX_OVER_X=over_x, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps)
    return (dx, y) if with_output else dx


def swiglu_backward_fp8_triton(grad_output: torch.Tensor, x: torch.Tensor,
                               fp8_dtype: torch.dtype, fp8_max: float, columnwise: bool,
                               delayed: Optional[DelayedCast] = None, block_m: int = 32,
                               block_n: int = 128, kind: str = "swiglu", interleave: int = 0,
                               clamp: tuple = CLAMP_DEFAULTS):
    """:func:`swiglu_backward_triton`'s result as :func:`swiglu_forward_fp8_triton` gives
    the forward's."""
    require_triton("swiglu_backward_fp8_triton")
    dy, x = grad_output.contiguous(), x.contiguous()
    m, n = _rows_and_half(x, kind, interleave)
    if not m * n:
        raise ValueError(f"swiglu_backward_fp8_triton: empty input {tuple(x.shape)}")
    grid = tile_grid(m, n, block_m, block_n)
    layout = _layout(kind, interleave, clamp)
    amax = scale_amax(delayed, x.device, lambda slot: _swiglu_bwd_kernel[grid](
        dy, x, slot, slot, slot, m, n, **layout, AMAX_ONLY=True, WRITE_Y=False,
        DX_OVER_X=False, BLOCK_M=block_m, BLOCK_N=block_n))
    like = dy.new_empty(()).expand(x.shape)
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(like, fp8_dtype, columnwise)
    _swiglu_bwd_cast_kernel[grid](dy, x, amax, data, transpose, scale_inv, m, n,
                                  **layout, FP8_MAX=fp8_max, **kernel_args(delayed, amax),
                                  HAS_T=in_kernel_t, BLOCK_M=block_m, BLOCK_N=block_n)
    finish(delayed)
    return fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)
