"""The attention's input preparation in one pass each way: the fused QKV projection's
output ``(T, (H + 2K) * D)`` split into q ``(T, H, D)``, k and v ``(T, K, D)``, with the
rotary embedding applied to q and k on the way (the formulas:
:mod:`fusible.functional.rotary`); the backward reads dq, dk, dv, rotates dq and dk back
and writes them side by side into the QKV gradient, so no transpose, split or cat runs
either way.

One program per block of tokens and one head; the angles' cosines and sines come as
float32 tables (one row per position, or per token), made by PyTorch as Hugging Face
makes them; the rotation is float32 in registers, rounded once.
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl, triton

# Tokens per program: about _BLOCK_ELEMENTS features of one head (16 tokens of 64 or 128
# features; more tokens of narrower heads, whose programs would otherwise be too small to
# hide their launch), 4 warps.
_BLOCK_ELEMENTS = 1024


@jit
def _own_head(q_ptr, k_ptr, v_ptr, head, H, K, D: tl.constexpr):
    """``head``'s first element in row 0 of its own tensor, and that tensor's row width."""
    if head < H:
        base = q_ptr + head * D
        width = H * D
    elif head < H + K:
        base = k_ptr + (head - H) * D
        width = K * D
    else:
        base = v_ptr + (head - H - K) * D
        width = K * D
    return base, width


@jit
def _qkv_rotary_kernel(packed_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, T, TABLE_ROWS, H, K,
                       D: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                       BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_P: tl.constexpr):
    """Forward: ``packed`` -> q, k, v (q and k rotated). Backward: dq, dk, dv -> ``packed``
    (dq and dk rotated back). Pairs ``(c1, c2)`` of the first ``2 * HALF`` features rotate;
    the rest, and every feature of v, are copied."""
    head = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    in_t = rows < T
    base, width = _own_head(q_ptr, k_ptr, v_ptr, head, H, K, D)
    packed_row = packed_ptr + rows[:, None] * ((H + 2 * K) * D) + head * D
    own_row = base + rows[:, None] * width
    if BACKWARD:
        src_row, dst_row = own_row, packed_row
    else:
        src_row, dst_row = packed_row, own_row
    j = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        c1, c2 = 2 * j, 2 * j + 1
    else:
        c1, c2 = j, j + HALF
    m = in_t[:, None] & (j < HALF)[None, :]
    table = (rows % TABLE_ROWS)[:, None] * HALF + j[None, :]
    cos = tl.load(cos_ptr + table, mask=m, other=1.0)
    sin = tl.load(sin_ptr + table, mask=m, other=0.0)
    if BACKWARD:
        sin = -sin
    x1 = tl.load(src_row + c1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src_row + c2[None, :], mask=m, other=0.0).to(tl.float32)
    rotate = head < H + K
    y1 = tl.where(rotate, x1 * cos - x2 * sin, x1)
    y2 = tl.where(rotate, x2 * cos + x1 * sin, x2)
    out_ty = dst_row.dtype.element_ty
    tl.store(dst_row + c1[None, :], y1.to(out_ty), mask=m)
    tl.store(dst_row + c2[None, :], y2.to(out_ty), mask=m)
    if D > 2 * HALF:  # partial rotary: the features past the rotated ones pass through
        cols = 2 * HALF + tl.arange(0, BLOCK_P)
        mp = in_t[:, None] & (cols < D)[None, :]
        x = tl.load(src_row + cols[None, :], mask=mp, other=0.0)
        tl.store(dst_row + cols[None, :], x.to(out_ty), mask=mp)


def _launch(packed, q, k, v, cos, sin, heads, kv_heads, head_dim, interleaved, backward,
            block_t):
    tokens, half = q.shape[0], cos.shape[-1]
    if not tokens:
        return
    block_t = block_t or max(16, triton.next_power_of_2(_BLOCK_ELEMENTS // head_dim))
    grid = (triton.cdiv(tokens, block_t), heads + 2 * kv_heads)
    _qkv_rotary_kernel[grid](
        packed, q, k, v, cos, sin, tokens, cos.shape[0], heads, kv_heads, D=head_dim,
        HALF=half, INTERLEAVED=interleaved, BACKWARD=backward, BLOCK_T=block_t,
        BLOCK_R=triton.next_power_of_2(max(half, 1)),
        BLOCK_P=triton.next_power_of_2(max(head_dim - 2 * half, 1)), num_warps=4)


def qkv_rotary_forward_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              heads: int, kv_heads: int, interleaved: bool,
                              block_t: int | None = None) -> torch.Tensor:
    """q ``(T, H, D)``, k and v ``(T, K, D)``, one after another in one flat buffer (the
    result), from ``qkv`` ``(T, (H + 2K) * D)`` contiguous, q and k rotated by the tables
    ``cos``, ``sin`` ``(R, rotary_dim / 2)`` float32, row ``t % R`` for token ``t``."""
    require_triton("qkv_rotary_forward")
    tokens, width = qkv.shape
    head_dim = width // (heads + 2 * kv_heads)
    buffer = qkv.new_empty(tokens * width)
    q = buffer[:tokens * heads * head_dim].view(tokens, heads, head_dim)
    k = buffer[q.numel():q.numel() + tokens * kv_heads * head_dim].view(tokens, kv_heads,
                                                                        head_dim)
    v = buffer[q.numel() + k.numel():].view(tokens, kv_heads, head_dim)
    _launch(qkv, q, k, v, cos, sin, heads, kv_heads, head_dim, interleaved, False, block_t)
    return buffer


def qkv_rotary_backward_triton(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                               cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                               block_t: int | None = None) -> torch.Tensor:
    """The QKV gradient ``(T, (H + 2K) * D)`` from contiguous ``dq`` ``(T, H, D)``, ``dk``
    and ``dv`` ``(T, K, D)``, dq and dk rotated back."""
    require_triton("qkv_rotary_backward")
    tokens, heads, head_dim = dq.shape
    kv_heads = dk.shape[1]
    packed = dq.new_empty(tokens, (heads + 2 * kv_heads) * head_dim)
    _launch(packed, dq, dk, dv, cos, sin, heads, kv_heads, head_dim, interleaved, True,
            block_t)
    return packed
