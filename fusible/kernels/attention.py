"""Attention in Triton for narrow heads (FlashAttention's algorithm: the scores never in
memory, a running maximum and sum per query row), on the ``(B, S, H, D)`` layout the QKV
preparation writes, causal or bidirectional, grouped-query (query head ``h`` reads kv
head ``h // (H / K)``).

Why our own: at 16-wide heads (the debugmodel's) a score costs one exponent and a few
multiply-adds on the CUDA cores against only 64 tensor-core FLOPs (its share of ``q k^T``
and ``p v``), so the exponent units bound the kernel, and cuDNN's forward takes 2.8x their
time (H100); loops that do little but the exponent come closer (2.0x). The
softmax is computed in base 2 (``exp2(s * scale * log2 e - m)``: one multiply-add and one
exponent a score); the log-sum-exp is stored in base e, ``(B, H, S)`` float32.

The backward is two kernels: the query rows' (dq; it also stores ``delta``, each row's
``sum(dout * out)``) and then the key rows' (dk and dv, summed over the kv head's query
heads in registers: no atomics). Each recomputes the probabilities from the
log-sum-exp.
"""

from __future__ import annotations

import torch

from fusible.kernels import jit, require_triton, tl, triton

_LOG2E = 1.4426950408889634

# Tiles: (BLOCK_M query rows, BLOCK_N key rows, warps, pipeline stages) per kernel, the
# fastest of benchmarks/diagnostics/attention_tiles.py's sweep on an H100 at 16- and
# 32-wide heads (docs/benchmarks.md); BLOCK_N divides BLOCK_M in the forward and the dq
# kernel, BLOCK_M divides BLOCK_N in the dk/dv kernel (the diagonal then falls in whole
# blocks). From 64-wide heads the dk/dv kernel's long tile spills its registers (4.4x).
FORWARD_TILE = (64, 64, 4, 3)
DQ_TILE = (64, 64, 4, 3)
DKV_TILE = (32, 128, 4, 3)
DKV_TILE_WIDE = (64, 64, 4, 3)


@jit
def _query_block(CAUSAL: tl.constexpr):
    """This program's block of query rows: causal, the longest rows first (the last
    programs then take the short ones)."""
    if CAUSAL:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)


@jit
def _forward_block(q, rows, m_i, l_i, acc, k_ptr, v_ptr, kv_off, start_n, S, stride_ks,
                   qk_scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr, D: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """One block of keys into the running maximum ``m_i``, sum ``l_i`` and ``acc``;
    ``MASKED``: the diagonal block or the last partial one."""
    n = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    if MASKED:
        k_t = tl.load(k_ptr + kv_off + n[None, :] * stride_ks + d[:, None],
                      mask=n[None, :] < S, other=0.0)
        v = tl.load(v_ptr + kv_off + n[:, None] * stride_ks + d[None, :],
                    mask=n[:, None] < S, other=0.0)
        seen = n[None, :] < S
        if CAUSAL:
            seen = seen & (n[None, :] <= rows[:, None])
        s = tl.where(seen, tl.dot(q, k_t) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    else:
        k_t = tl.load(k_ptr + kv_off + n[None, :] * stride_ks + d[:, None])
        v = tl.load(v_ptr + kv_off + n[:, None] * stride_ks + d[None, :])
        s = tl.dot(q, k_t)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one multiply-add a score
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, S, H, GROUPS, stride_qb, stride_qs,
                    stride_kb, stride_ks, qk_scale, CAUSAL: tl.constexpr, D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: ``BLOCK_M`` query rows of one head (causal: the longest rows first)."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    start_m = _query_block(CAUSAL) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    at = b.to(tl.int64) * stride_qb + h * D + rows[:, None] * stride_qs + d[None, :]
    kv_off = b.to(tl.int64) * stride_kb + (h // GROUPS) * D
    q = tl.load(q_ptr + at, mask=rows[:, None] < S, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    if CAUSAL:
        unmasked, end = start_m, tl.minimum(start_m + BLOCK_M, S)
    else:
        unmasked, end = (S // BLOCK_N) * BLOCK_N, S
    for start_n in range(0, unmasked, BLOCK_N):
        m_i, l_i, acc = _forward_block(q, rows, m_i, l_i, acc, k_ptr, v_ptr, kv_off, start_n,
                                       S, stride_ks, qk_scale, CAUSAL, False, D, BLOCK_N)
    for start_n in range(unmasked, end, BLOCK_N):
        m_i, l_i, acc = _forward_block(q, rows, m_i, l_i, acc, k_ptr, v_ptr, kv_off, start_n,
                                       S, stride_ks, qk_scale, CAUSAL, True, D, BLOCK_N)
    acc = acc / l_i[:, None]
    tl.store(o_ptr + at, acc.to(o_ptr.dtype.element_ty), mask=rows[:, None] < S)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # base 2 to base e
    tl.store(lse_ptr + bh.to(tl.int64) * S + rows, lse, mask=rows < S)


@jit
def _dq_block(q, do, lse2, delta, rows, dq, k_ptr, v_ptr, kv_off, start_n, S, stride_ks,
              qk_scale, CAUSAL: tl.constexpr, MASKED: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """One block of keys into ``dq``; ``MASKED``: the causal diagonal or the last partial
    block, whose keys past ``S`` (read as zeros) get probability 0 (unmasked, a row whose
    scores are all far below zero would make ``exp2(-lse)`` infinite there)."""
    n = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    k = tl.load(k_ptr + kv_off + n[:, None] * stride_ks + d[None, :], mask=n[:, None] < S,
                other=0.0)
    v_t = tl.load(v_ptr + kv_off + n[None, :] * stride_ks + d[:, None], mask=n[None, :] < S,
                  other=0.0)
    p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
    if MASKED:
        seen = n[None, :] < S
        if CAUSAL:
            seen = seen & (n[None, :] <= rows[:, None])
        p = tl.where(seen, p, 0.0)
    ds = p * (tl.dot(do, v_t) - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq)


@jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, S, H, GROUPS,
               stride_qb, stride_qs, stride_kb, stride_ks, qk_scale, scale,
               CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """One program: dq of ``BLOCK_M`` query rows of one head; stores their ``delta``."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    start_m = _query_block(CAUSAL) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    in_s = rows[:, None] < S
    at = b.to(tl.int64) * stride_qb + h * D + rows[:, None] * stride_qs + d[None, :]
    kv_off = b.to(tl.int64) * stride_kb + (h // GROUPS) * D
    q = tl.load(q_ptr + at, mask=in_s, other=0.0)
    do = tl.load(do_ptr + at, mask=in_s, other=0.0)
    o = tl.load(o_ptr + at, mask=in_s, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    row_at = bh.to(tl.int64) * S + rows
    tl.store(delta_ptr + row_at, delta, mask=rows < S)
    lse2 = tl.load(lse_ptr + row_at, mask=rows < S, other=0.0) * 1.4426950408889634
    dq = tl.zeros((BLOCK_M, D), tl.float32)
    if CAUSAL:
        unmasked, end = start_m, tl.minimum(start_m + BLOCK_M, S)
    else:
        unmasked, end = (S // BLOCK_N) * BLOCK_N, S
    for start_n in range(0, unmasked, BLOCK_N):
        dq = _dq_block(q, do, lse2, delta, rows, dq, k_ptr, v_ptr, kv_off, start_n, S,
                       stride_ks, qk_scale, CAUSAL, False, D, BLOCK_N)
    for start_n in range(unmasked, end, BLOCK_N):
        dq = _dq_block(q, do, lse2, delta, rows, dq, k_ptr, v_ptr, kv_off, start_n, S,
                       stride_ks, qk_scale, CAUSAL, True, D, BLOCK_N)
    tl.store(dq_ptr + at, (dq * scale).to(dq_ptr.dtype.element_ty), mask=in_s)


@jit
def _dkv_block(k, v, n, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, q_off, row_off, start_m, S,
               stride_qs, qk_scale, MASKED: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """One block of query rows into ``dk`` and ``dv``. Rows past ``S`` read as zeros with
    an infinite log-sum-exp: probability 0; ``MASKED``: the causal diagonal."""
    m = start_m + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    at = q_off + m[:, None] * stride_qs + d[None, :]
    q = tl.load(q_ptr + at, mask=m[:, None] < S, other=0.0)
    do = tl.load(do_ptr + at, mask=m[:, None] < S, other=0.0)
    lse2 = tl.load(lse_ptr + row_off + m, mask=m < S, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + row_off + m, mask=m < S, other=0.0)
    p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
    if MASKED:
        p_t = tl.where(m[None, :] >= n[:, None], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@jit
def _dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, S, H, K,
                GROUPS, stride_qb, stride_qs, stride_kb, stride_ks, qk_scale, scale,
                CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """One program: dk and dv of ``BLOCK_N`` key rows of one kv head, summed over its
    query heads in registers."""
    bk = tl.program_id(1)
    b, kv = bk // K, bk % K
    start_n = tl.program_id(0) * BLOCK_N
    n = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    kv_at = b.to(tl.int64) * stride_kb + kv * D + n[:, None] * stride_ks + d[None, :]
    k = tl.load(k_ptr + kv_at, mask=n[:, None] < S, other=0.0)
    v = tl.load(v_ptr + kv_at, mask=n[:, None] < S, other=0.0)
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    if CAUSAL:  # rows before the block see none of it; the block's own, the diagonal
        first, unmasked = start_n, tl.minimum(start_n + BLOCK_N, S)
    else:
        first, unmasked = 0, 0
    for g in range(0, GROUPS):
        h = kv * GROUPS + g
        q_off = b.to(tl.int64) * stride_qb + h * D
        row_off = (b * H + h).to(tl.int64) * S
        for start_m in range(first, unmasked, BLOCK_M):
            dk, dv = _dkv_block(k, v, n, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, q_off,
                                row_off, start_m, S, stride_qs, qk_scale, True, D, BLOCK_M)
        for start_m in range(unmasked, S, BLOCK_M):
            dk, dv = _dkv_block(k, v, n, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, q_off,
                                row_off, start_m, S, stride_qs, qk_scale, False, D, BLOCK_M)
    tl.store(dk_ptr + kv_at, (dk * scale).to(dk_ptr.dtype.element_ty), mask=n[:, None] < S)
    tl.store(dv_ptr + kv_at, dv.to(dv_ptr.dtype.element_ty), mask=n[:, None] < S)


def _strides(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """The batch and sequence strides; ValueError where one batch row's offsets pass 32
    bits (the kernels address within a row in int32, the rows themselves in int64)."""
    if q.shape[1] * q.stride(1) >= 2**31:
        raise ValueError(f"attention (triton): one sequence of {q.shape[1]} tokens x "
                         f"{q.stride(1)} features passes the kernels' 32-bit offsets; use "
                         f"backend='cudnn' or 'flash'")
    return q.stride(0), q.stride(1), k.stride(0), k.stride(1)


def _check_tile(name: str, tile: tuple, diagonal_blocks: str) -> tuple:
    """``tile`` where its blocks put the causal diagonal in whole blocks, which the
    kernels' loop bounds assume; ValueError otherwise."""
    block_m, block_n = tile[:2]
    small, large = (block_n, block_m) if diagonal_blocks == "keys" else (block_m, block_n)
    if large % small or min(tile[:2]) < 16:
        raise ValueError(f"attention (triton): the {name} tile {tile} needs BLOCK_M and "
                         f"BLOCK_N of 16 or more, "
                         + ("BLOCK_N dividing BLOCK_M" if diagonal_blocks == "keys"
                            else "BLOCK_M dividing BLOCK_N"))
    return tile


def attention_forward_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                             scale: float, tile: tuple | None = None) -> tuple:
    """``(out, lse)``: ``out`` ``(B, S, H, D)`` contiguous, ``lse`` ``(B, H, S)`` float32
    (base e), from ``q`` ``(B, S, H, D)``, ``k`` and ``v`` ``(B, S, K, D)`` (``H`` a multiple
    of ``K``; ``D`` a power of two from 16)."""
    block_m, block_n, warps, stages = _check_tile("forward", tile or FORWARD_TILE, "keys")
    require_triton("attention_forward")
    q, k, v = (t.contiguous() for t in (q, k, v))  # (no copies for the QKV kernel's)
    b, s, h, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    if not out.numel():
        return out, lse
    _forward_kernel[(triton.cdiv(s, block_m), b * h)](
        q, k, v, out, lse, s, h, h // k.shape[2], *_strides(q, k), scale * _LOG2E,
        CAUSAL=causal, D=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        num_stages=stages)
    return out, lse


def attention_backward_triton(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              causal: bool, scale: float, dq_tile: tuple | None = None,
                              dkv_tile: tuple | None = None) -> tuple:
    """``(dq, dk, dv)``, contiguous, of the shapes of ``q``, ``k``, ``v``."""
    dq_tile = _check_tile("dq", dq_tile or DQ_TILE, "keys")
    dkv_tile = _check_tile("dk/dv", dkv_tile or (DKV_TILE if q.shape[-1] <= 32
                                                 else DKV_TILE_WIDE), "queries")
    require_triton("attention_backward")
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    b, s, h, d = q.shape
    kv_heads = k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if not q.numel():
        return dq, dk, dv
    delta = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    groups = h // kv_heads
    block_m, block_n, warps, stages = dq_tile
    _dq_kernel[(triton.cdiv(s, block_m), b * h)](
        q, k, v, out, dout, lse, delta, dq, s, h, groups, *_strides(q, k), scale * _LOG2E,
        scale, CAUSAL=causal, D=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        num_stages=stages)
    block_m, block_n, warps, stages = dkv_tile
    _dkv_kernel[(triton.cdiv(s, block_n), b * kv_heads)](
        q, k, v, dout, lse, delta, dk, dv, s, h, kv_heads, groups, *_strides(q, k),
        scale * _LOG2E, scale, CAUSAL=causal, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    return dq, dk, dv
