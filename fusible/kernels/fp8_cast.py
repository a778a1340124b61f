"""FP8 cast with per-tensor current scaling: two Triton kernels instead of ~10 PyTorch ops.

The first kernel reads ``x`` once for its absolute maximum (an atomic max per program:
order-independent, so deterministic). The second reads ``x`` again, derives the scale
from that maximum on the device, and writes the FP8 data and, in the same pass, its
transposed copy. The arithmetic is the PyTorch version's step by step (IEEE division,
float32 multiply, clamp that keeps NaN, round-to-nearest-even conversion), so both
give the same bits; ``tests/test_cuda.py`` checks that on the GPU.
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, plain_eager, require_triton, tl, triton


@jit
def max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def _amax_kernel(x_ptr, amax_ptr, n, per_program, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for offset in range(0, per_program, BLOCK):
        offs = start + offset + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
    tl.atomic_max(amax_ptr, tl.reduce(acc, 0, max_keep_nan))


@jit
def scale_from_amax(amax_ptr, FP8_MAX):
    """The current scale from the amax on the device (:func:`scale_of_amax`)."""
    return scale_of_amax(tl.load(amax_ptr), FP8_MAX)


@jit
def scale_of_amax(amax, FP8_MAX):
    """``FP8_MAX / amax`` (elementwise), at most the largest float32 (tiny tensors stay
    finite), 1 for 0, NaN for a NaN amax."""
    scale = tl.minimum(tl.math.div_rn(FP8_MAX, amax), 3.4028234663852886e38,
                       propagate_nan=tl.PropagateNan.ALL)
    return tl.where(amax == 0.0, 1.0, scale)


@jit
def tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's ``(rows, cols, mask)`` of an ``M x N`` tensor on the 1-D grid of
    :func:`tile_grid`: row tiles vary fastest (a column strip is walked down, as a 2-D
    grid would), and no grid axis limits ``M`` or ``N``."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    rows = (pid % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, (rows[:, None] < M) & (cols[None, :] < N)


@jit
def atomic_amax_of_tile(v, mask, amax_ptr):
    """Fold the absolute maximum of the float32 tile ``v`` (where ``mask``) into
    ``*amax_ptr`` (an atomic max: order-independent; NaN wins)."""
    tile_max = tl.reduce(tl.where(mask, tl.abs(v), 0.0), 1, max_keep_nan)
    tl.atomic_max(amax_ptr, tl.reduce(tile_max, 0, max_keep_nan))


@jit
def quantize_tile(x, scale, scale_inv_ptr, FP8_MAX):
    """The float32 tile ``x * scale`` saturated to +-FP8_MAX (NaN kept), not yet
    rounded to FP8; the first program stores ``1 / scale``."""
    if tl.program_id(0) == 0:  # 1-D grids (tile_grid)
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))
    return saturate(x * scale, FP8_MAX)


@jit
def saturate(v, FP8_MAX):
    """``v`` clamped to +-FP8_MAX, NaN kept and infinities made NaN: a scale from history
    must not turn an overflow to inf into the largest finite value (NaN: E4M3 has no
    infinity, and the conversions saturate one)."""
    clamped = tl.maximum(v, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    clamped = tl.minimum(clamped, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(tl.abs(v) == float("inf"), float("nan"), clamped)


@jit
def store_transposed_tile(v, rows, cols, mask, t_ptr, M):
    """Store the quantized tile ``v`` (rows x cols) into the N x M transposed copy: the
    float32 tile transposed, then converted, stores along the copy's rows."""
    t_offs = cols[:, None].to(tl.int64) * M + rows[None, :]
    q_t = tl.trans(v).to(t_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(t_ptr + t_offs, q_t, mask=tl.trans(mask))


@jit
def store_fp8_tile(x, scale, rows, cols, mask, data_ptr, t_ptr, scale_inv_ptr, M, N,
                   FP8_MAX, HAS_T: tl.constexpr):
    """Quantize the float32 tile ``x`` (rows x cols of an M x N tensor) and store it,
    and its transpose into the N x M copy; the first program stores ``1 / scale``."""
    v = quantize_tile(x, scale, scale_inv_ptr, FP8_MAX)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(data_ptr + offs, v.to(data_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)
    if HAS_T:
        store_transposed_tile(v, rows, cols, mask, t_ptr, M)


@jit
def _cast_kernel(x_ptr, amax_ptr, data_ptr, t_ptr, scale_inv_ptr, M, N, FP8_MAX,
                 HAS_T: tl.constexpr, HAS_DATA: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    # The second grid axis walks the batches of a batched cast (one amax and scale each,
    # cast_batched_triton); a plain cast has one.
    batch = tl.program_id(1).to(tl.int64)
    x_ptr += batch * M * N
    data_ptr += batch * M * N
    t_ptr += batch * M * N
    amax_ptr += batch
    scale_inv_ptr += batch
    scale = scale_from_amax(amax_ptr, FP8_MAX)
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DATA:
        store_fp8_tile(x, scale, rows, cols, mask, data_ptr, t_ptr, scale_inv_ptr, M, N,
                       FP8_MAX, HAS_T)
    else:  # the transposed copy alone
        store_transposed_tile(quantize_tile(x, scale, scale_inv_ptr, FP8_MAX), rows, cols,
                              mask, t_ptr, M)


@jit
def _transpose_kernel(src_ptr, dst_ptr, M, N, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """dst (N x M) = src (M x N) transposed, bytes. The tile is loaded already as
    (cols, rows), no ``tl.trans``; the compiler stages it through shared memory so
    that both the loads and the stores are coalesced."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (cols[:, None] < N) & (rows[None, :] < M)
    tile = tl.load(src_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], mask=mask)
    tl.store(dst_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], tile, mask=mask)


def tile_grid(m: int, n: int, block_m: int, block_n: int) -> tuple:
    """The 1-D grid of the tile kernels (see ``tile_coords``): one program per
    ``block_m x block_n`` tile of an ``m x n`` tensor. One axis: CUDA caps the second and
    third at 65535 programs, which a LayerNorm over several dimensions passes."""
    return (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)


class _ZeroedSlots:
    """Zeroed float32 amax accumulators of one device and stream, handed out in turn:
    the kernels fold their absolute maxima in with atomics, which need a zero to start
    from, and a fresh ``torch.zeros`` per cast is one more launch and allocation (about
    30 us of host time each in a host-bound FP8 step, six casts a step). One fill
    re-zeroes all the slots once they have been handed out; being on the slots' stream,
    it runs after every kernel that used them. Each slot is 16-byte aligned, as Triton
    specialises pointers."""

    count = 1024
    stride = 4  # float32 elements between slots: 16 bytes

    def __init__(self, device: torch.device):
        self.buffer = torch.zeros(self.count * self.stride, device=device, dtype=torch.float32)
        self.slots = list(self.buffer[::self.stride].unbind())
        self.next = 0

    def take(self) -> torch.Tensor:
        if self.next == len(self.slots):
            self.buffer.zero_()
            self.next = 0
        self.next += 1
        return self.slots[self.next - 1]


_SLOTS: dict = {}  # (device, stream) -> _ZeroedSlots
_IN_OP = [0]      # how many custom-op kernels (fresh_zeros_inside) are running


def fresh_zeros_inside(kernel):
    """``kernel`` (a custom op's), with :func:`zeroed_amax` giving fresh zeros while it
    runs: torch.compile's CUDA graph trees run compiled graphs once before recording them,
    allocating from the graph's private pool, where slots would stay allocated (which
    the trees refuse)."""
    def run(*args):
        _IN_OP[0] += 1
        try:
            return kernel(*args)
        finally:
            _IN_OP[0] -= 1
    return run


def zeroed_amax(device: torch.device) -> torch.Tensor:
    """A zeroed 0-d float32 tensor on ``device`` for a kernel's atomic amax, to be used up
    by the next kernels on the current stream (a slot of :class:`_ZeroedSlots`). A fresh
    ``torch.zeros`` inside a custom op's kernel (:func:`fresh_zeros_inside`) and while a
    CUDA graph is being captured (its fill is captured with the kernels, so every replay
    starts from zero)."""
    cuda = device.type == "cuda"
    if _IN_OP[0] or cuda and torch.cuda.is_current_stream_capturing():
        return torch.zeros((), device=device, dtype=torch.float32)
    if cuda:
        key = device, torch._C._cuda_getCurrentStream(device.index)[0]
    else:  # Triton's interpreter: one stream
        key = device, 0
    slots = _SLOTS.get(key)
    if slots is None:
        slots = _SLOTS[key] = _ZeroedSlots(device)
    return slots.take()


def amax_triton(x: torch.Tensor, block: int = 4096, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The float32 0-d absolute maximum of the non-empty ``x`` (NaN if any is NaN),
    written into ``out`` (zeroed, 0-d float32) where given."""
    require_triton("amax_triton")
    x = x.contiguous()
    amax = torch.zeros((), device=x.device, dtype=torch.float32) if out is None else out
    # Few enough programs that the atomics on one address stay cheap.
    programs = min(triton.cdiv(x.numel(), block), 2048)
    per_program = triton.cdiv(triton.cdiv(x.numel(), programs), block) * block
    _amax_kernel[(programs,)](x, amax, x.numel(), per_program, BLOCK=block)
    return amax


def cast_to_fp8_triton(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                       columnwise: bool, block: int = 4096, block_m: int = 64,
                       block_n: int = 128, amax: torch.Tensor | None = None,
                       rowwise: bool = True) -> list:
    """``[data, scale_inv]`` (+ ``transpose``) as
    ``fusible.quantization.casts.tensorwise.cast_tensorwise``; a given ``amax`` (float32,
    0-d) skips the amax kernel. Without ``rowwise`` (with ``columnwise``): ``[transpose,
    scale_inv]``, the data never written where the kernel writes the copy itself."""
    require_triton("cast_to_fp8_triton")
    if not (rowwise or columnwise):
        raise ValueError("cast_to_fp8_triton: asked for neither the data nor its transpose")
    x = x.contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    if amax is None:
        amax = amax_triton(x, block, out=zeroed_amax(x.device))
    else:
        amax = amax.to(torch.float32).contiguous()
    has_data = rowwise or not (columnwise and transposes_in_kernel(x.dtype))
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(x, fp8_dtype, columnwise, has_data)
    _cast_kernel[tile_grid(n_rows, n_cols, block_m, block_n)](
        x, amax, data, transpose, scale_inv, n_rows, n_cols, fp8_max, HAS_T=in_kernel_t,
        HAS_DATA=has_data, BLOCK_M=block_m, BLOCK_N=block_n)
    out = fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)
    return out if rowwise else [out[2], scale_inv]


def cast_batched_triton(x: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype,
                        fp8_max: float, rowwise: bool = True, columnwise: bool = False,
                        block_m: int = 64, block_n: int = 128) -> tuple:
    """``(data, transpose, scale_inv)``: each batch ``b`` of ``x`` (batches, M, N) cast
    with the scale of ``amax[b]`` (float32, (batches,)), as :func:`cast_to_fp8_triton`
    casts a tensor; ``data`` (batches, M, N) where ``rowwise``, ``transpose`` (batches, N,
    M) row-major where ``columnwise`` (None where not asked for), both from one read of
    ``x`` (the copy written by the kernel from 16-bit data, else transposed after it)."""
    require_triton("cast_batched_triton")
    if not (rowwise or columnwise):
        raise ValueError("cast_batched_triton: asked for neither the data nor its transpose")
    x = x.contiguous()
    batches, m, n = x.shape
    amax = amax.to(torch.float32).contiguous()
    in_kernel_t = columnwise and transposes_in_kernel(x.dtype)
    has_data = rowwise or not in_kernel_t
    data = torch.empty((batches, m, n), device=x.device, dtype=fp8_dtype) if has_data else None
    transpose = torch.empty((batches, n, m), device=x.device, dtype=fp8_dtype) \
        if in_kernel_t else None
    scale_inv = torch.empty(batches, device=x.device, dtype=torch.float32)
    first = data if has_data else transpose
    _cast_kernel[(tile_grid(m, n, block_m, block_n)[0], batches)](
        x, amax, first, transpose if in_kernel_t else first, scale_inv, m, n, fp8_max,
        HAS_T=in_kernel_t, HAS_DATA=has_data, BLOCK_M=block_m, BLOCK_N=block_n)
    if columnwise and not in_kernel_t:
        assert data is not None  # has_data
        transpose = data.transpose(-2, -1).contiguous()
    return data if rowwise else None, transpose, scale_inv


# From here the kernel wins: on an H200 it moves 3.5 TB/s at 16384 x 8192 where PyTorch's
# strided copy of one-byte elements moves 0.33; at 2 M elements the launch costs more than
# the copy (benchmarks/diagnostics/fp8_transpose.py).
_TRITON_TRANSPOSE_MIN_NUMEL = 1 << 22


def transposed_copy(data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The (features, tokens) row-major copy of ``data`` seen as (tokens, features),
    written into ``out`` when given.

    Large FP8 data on CUDA is transposed by a Triton kernel where nothing traces;
    anything else by PyTorch.
    """
    data2 = data.reshape(-1, data.shape[-1])
    if (data.is_cuda and data.element_size() == 1 and triton is not None
            and data.numel() >= _TRITON_TRANSPOSE_MIN_NUMEL and plain_eager(data)):
        return transpose_bytes_triton(data2, out=out)
    if out is not None:
        return out.copy_(data2.t())
    # clone, not contiguous(): with one row or column the transpose is already contiguous
    # and contiguous() would hand back a view of the data (custom ops' results may not alias)
    return data2.t().clone(memory_format=torch.contiguous_format)


def transpose_bytes_triton(data: torch.Tensor, block: int = 128,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """The contiguous transpose of the 2-D one-byte tensor ``data``, by Triton (into the
    contiguous ``out`` when given)."""
    rows, cols = data.shape
    if out is None:
        out = torch.empty((cols, rows), device=data.device, dtype=data.dtype)
    grid = (triton.cdiv(rows, block), triton.cdiv(cols, block))
    _transpose_kernel[grid](data.contiguous().view(torch.uint8), out.view(torch.uint8),
                            rows, cols, BLOCK_M=block, BLOCK_N=block)
    return out


def transposes_in_kernel(dtype: torch.dtype) -> bool:
    """Whether the cast kernels write the transposed copy for a ``dtype`` source.

    Only bfloat16: on an H200 with Triton 3.6 the in-kernel transposed store gave wrong
    bytes for float32 sources (tests/test_cuda.py); other sources get the copy from a
    PyTorch transpose of the FP8 data (one more pass over it, same bits).
    """
    return dtype == torch.bfloat16


def fp8_buffers(source: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool,
                has_data: bool = True) -> tuple:
    """``(data, transpose, scale_inv, HAS_T)``: what a cast kernel writes for ``source``.

    ``transpose`` is ``data`` (an unused pointer) when the kernel does not write it;
    without ``has_data`` (the kernel writes the transposed copy alone) ``data`` is that
    copy, an unused pointer.
    """
    n = source.shape[-1]
    in_kernel_t = columnwise and transposes_in_kernel(source.dtype)
    transpose = (torch.empty((n, source.numel() // n), device=source.device, dtype=fp8_dtype)
                 if in_kernel_t else None)
    data = (torch.empty(source.shape, device=source.device, dtype=fp8_dtype)
            if has_data or transpose is None else transpose)
    transpose = data if transpose is None else transpose
    scale_inv = torch.empty((), device=source.device, dtype=torch.float32)
    return data, transpose, scale_inv, in_kernel_t


def fp8_results(data, scale_inv, transpose, columnwise: bool, in_kernel_t: bool) -> list:
    """``[data, scale_inv]`` (+ the transposed copy, made here if the kernel did not)."""
    if not columnwise:
        return [data, scale_inv]
    return [data, scale_inv, transpose if in_kernel_t else transposed_copy(data)]
