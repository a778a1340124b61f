"""The attention's input preparation in one pass each way: the fused QKV projection's
output ``(T, (H + 2K) * D)`` split into q ``(T, H, D)``, k and v ``(T, K, D)``, with the
rotary embedding applied to q and k on the way (the formulas:
:mod:`fusible.functional.rotary`); the backward reads dq, dk, dv, rotates dq and dk back
and writes them side by side into the QKV gradient, so no transpose, split or cat runs
either way.

One program per block of tokens and a few adjacent heads; the angles' cosines and sines come as
float32 tables (one row per position, or per token), made by PyTorch as Hugging Face
makes them; the rotation is float32 in registers, rounded once.
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl, triton

# A program: adjacent heads of about _GROUP_FEATURES features together (rows read whole, not
# in pieces of one narrow head), for about _BLOCK_ELEMENTS features in all, 4 warps.
_GROUP_FEATURES = 128
_BLOCK_ELEMENTS = 2048


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
                       BACKWARD: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """Forward: ``packed`` -> q, k, v (q and k rotated). Backward: dq, dk, dv -> ``packed``
    (dq and dk rotated back). A program takes ``GROUP`` adjacent heads of one of q, k, v
    (contiguous on both sides) for ``BLOCK_T`` tokens, and reads each feature with its
    pair's partner: pairs ``(c1, c2)`` of the first ``2 * HALF`` features of a head rotate
    as ``x * cos + rotate_half(x) * sin``; the rest, and every feature of v, are copied."""
    head = tl.program_id(1) * GROUP
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    in_t = rows < T
    base, width = _own_head(q_ptr, k_ptr, v_ptr, head, H, K, D)
    packed_row = packed_ptr + rows[:, None] * ((H + 2 * K) * D) + head * D
    own_row = base + rows[:, None] * width
    if BACKWARD:
        src_row, dst_row = own_row, packed_row
    else:
        src_row, dst_row = packed_row, own_row
    c = tl.arange(0, BLOCK_C)
    f = c % D  # the feature within its head
    rotates = f < 2 * HALF
    if INTERLEAVED:
        first = (f % 2) == 0
        partner = tl.where(first, c + 1, c - 1)
        j = f // 2
    else:
        first = f < HALF
        partner = tl.where(first, c + HALF, c - HALF)
        j = tl.where(first, f, f - HALF)
    partner = tl.where(rotates, partner, c)
    m = in_t[:, None] & (c < GROUP * D)[None, :]
    mr = m & rotates[None, :]
    table = (rows % TABLE_ROWS)[:, None] * HALF + j[None, :]
    cos = tl.load(cos_ptr + table, mask=mr, other=1.0)
    sin = tl.load(sin_ptr + table, mask=mr, other=0.0)
    if BACKWARD:
        sin = -sin
    x = tl.load(src_row + c[None, :], mask=m, other=0.0).to(tl.float32)
    # rotate_half: the first of a pair takes its partner negated, the second as it is
    turned = tl.load(src_row + partner[None, :], mask=mr, other=0.0).to(tl.float32)
    turned = tl.where(first[None, :], -turned, turned)
    y = tl.where((head < H + K) & rotates[None, :], x * cos + turned * sin, x)
    tl.store(dst_row + c[None, :], y.to(dst_row.dtype.element_ty), mask=m)


def _group(heads: int, kv_heads: int, head_dim: int) -> int:
    """Adjacent heads per program: up to _GROUP_FEATURES features, never across q, k, v."""
    group = max(1, _GROUP_FEATURES // head_dim)
    while heads % group or kv_heads % group:
        group //= 2
    return max(group, 1)


def _launch(packed, q, k, v, cos, sin, heads, kv_heads, head_dim, interleaved, backward,
            block_t, group):
    tokens, half = q.shape[0], cos.shape[-1]
    if not tokens:
        return
    group = group or _group(heads, kv_heads, head_dim)
    block_c = triton.next_power_of_2(group * head_dim)
    block_t = block_t or max(1, _BLOCK_ELEMENTS // block_c)
    grid = (triton.cdiv(tokens, block_t), (heads + 2 * kv_heads) // group)
    _qkv_rotary_kernel[grid](
        packed, q, k, v, cos, sin, tokens, cos.shape[0], heads, kv_heads, D=head_dim,
        HALF=half, INTERLEAVED=interleaved, BACKWARD=backward, GROUP=group, BLOCK_T=block_t,
        BLOCK_C=block_c, num_warps=4)


def qkv_rotary_forward_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              heads: int, kv_heads: int, interleaved: bool,
                              block_t: int | None = None,
                              group: int | None = None) -> torch.Tensor:
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
    _launch(qkv, q, k, v, cos, sin, heads, kv_heads, head_dim, interleaved, False, block_t,
            group)
    return buffer


def qkv_rotary_backward_triton(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                               cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                               block_t: int | None = None,
                               group: int | None = None) -> torch.Tensor:
    """The QKV gradient ``(T, (H + 2K) * D)`` from contiguous ``dq`` ``(T, H, D)``, ``dk``
    and ``dv`` ``(T, K, D)``, dq and dk rotated back."""
    require_triton("qkv_rotary_backward")
    tokens, heads, head_dim = dq.shape
    kv_heads = dk.shape[1]
    packed = dq.new_empty(tokens, (heads + 2 * kv_heads) * head_dim)
    _launch(packed, dq, dk, dv, cos, sin, heads, kv_heads, head_dim, interleaved, True,
            block_t, group)
    return packed
