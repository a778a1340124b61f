"""The attention's inputs from a fused QKV projection's output, and the gradient back: the
split into heads, the optional per-head RMSNorm of q and k (Qwen3's ``q_norm`` /
``k_norm``) and the rotary embedding (:mod:`fusible.functional.rotary`).

``qkv`` ``(B, S, (H + 2K) * D)`` holds the ``H`` query heads, then the ``K`` key heads,
then the ``K`` value heads. On CUDA with a rotary embedding and no q/k norm, one Triton
kernel each way (:mod:`fusible.kernels.rotary`); elsewhere the PyTorch ops.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.functional.norms import rms_norm_backward, rms_norm_forward
from fusible.functional.rotary import RotaryOptions, apply_rotary
from fusible.kernels import triton_can_run
from fusible.kernels import rotary as rotary_kernels

Tensor = torch.Tensor


@attrs.frozen
class HeadLayout:
    """The heads of a fused QKV projection's output.

    Attributes
    ----------
    heads, kv_heads : int
        Query heads and key/value heads (grouped-query attention: ``heads`` a multiple).
    head_dim : int
    """

    heads: int
    kv_heads: int
    head_dim: int


def positions(batch: int, seq: int, cu_seqlens: Optional[Tensor],
              position_ids: Optional[Tensor], device) -> Tensor:
    """Each token's position ``(B, S)`` (or ``(S,)`` when implied, shared by the rows):
    the given ids, else the offset in its document for packed documents, else ``0..S-1``."""
    if position_ids is not None:
        return position_ids.expand(batch, seq)
    tokens = torch.arange(seq, device=device)
    if cu_seqlens is None:
        return tokens
    starts = cu_seqlens.long()[torch.searchsorted(cu_seqlens[1:-1].long(), tokens, right=True)]
    return (tokens - starts).expand(batch, seq)


def split(qkv: Tensor, layout: HeadLayout) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)`` as views ``(B, S, heads, D)`` of ``qkv``."""
    heads = qkv.view(*qkv.shape[:-1], layout.heads + 2 * layout.kv_heads, layout.head_dim)
    return heads.split([layout.heads, layout.kv_heads, layout.kv_heads], -2)


def views(prepared: Tensor, batch: int, seq: int, layout: HeadLayout) -> tuple:
    """q, k, v ``(B, S, heads, D)``: views of the flat buffer holding them one after
    another."""
    counts = (layout.heads, layout.kv_heads, layout.kv_heads)
    parts = prepared.split([batch * seq * n * layout.head_dim for n in counts])
    return tuple(part.view(batch, seq, n, layout.head_dim) for part, n in zip(parts, counts))


def _kernel_ok(qkv: Tensor, rotary: Optional[RotaryOptions], qk_norm: bool) -> bool:
    return rotary is not None and not qk_norm and triton_can_run(qkv) and qkv.is_contiguous()


def prepare_forward(qkv: Tensor, layout: HeadLayout, angles: Optional[tuple],
                    rotary: Optional[RotaryOptions], q_weight: Optional[Tensor],
                    k_weight: Optional[Tensor], eps: float) -> tuple:
    """``(prepared, (q, k, v), q_rstd, k_rstd)``: q, k, v ``(B, S, heads, D)`` normed (with
    the weights given) and rotated by ``angles`` (``(cos, sin)`` float32 ``(S, R / 2)``
    or ``(B, S, R / 2)``; None without ``rotary``), views of the flat buffer ``prepared``
    (None without norms and rotary: then views of ``qkv``); the rstds (None without
    norms) for the backward."""
    b, s = qkv.shape[:2]
    if rotary is not None and _kernel_ok(qkv, rotary, q_weight is not None):
        assert angles is not None  # made for the rotary embedding
        cos, sin = angles
        prepared = rotary_kernels.qkv_rotary_forward_triton(
            qkv.flatten(0, 1), cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]),
            layout.heads, layout.kv_heads, rotary.interleaved)
        return prepared, views(prepared, b, s, layout), None, None
    q, k, v = split(qkv, layout)
    if rotary is None and q_weight is None:
        return None, (q, k, v), None, None
    q_rstd = k_rstd = None
    if q_weight is not None:
        assert k_weight is not None  # the norms come in pairs
        q, q_rstd = rms_norm_forward(q.contiguous(), q_weight, [layout.head_dim], eps)
        k, k_rstd = rms_norm_forward(k.contiguous(), k_weight, [layout.head_dim], eps)
    if rotary is not None:
        assert angles is not None
        cos, sin = angles
        q, k = apply_rotary(q, cos, sin, rotary), apply_rotary(k, cos, sin, rotary)
    flat = torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
    return flat, views(flat, b, s, layout), q_rstd, k_rstd


def prepare_backward(dq: Tensor, dk: Tensor, dv: Tensor, layout: HeadLayout,
                     angles: Optional[tuple],
                     rotary: Optional[RotaryOptions], norm_saved: Optional[tuple],
                     need_norm_weights: bool) -> tuple:
    """``(dqkv, dq_weight, dk_weight)``: the QKV gradient ``(B, S, (H + 2K) * D)`` and the
    norm weights' gradients (None without norms, or when not needed). ``norm_saved`` is
    ``(q_in, k_in, q_rstd, k_rstd, q_weight, k_weight)``: the norms' inputs (the split
    heads), statistics and weights."""
    if rotary is not None and _kernel_ok(dq, rotary, norm_saved is not None) and \
            dk.is_contiguous() and dv.is_contiguous():
        assert angles is not None
        cos, sin = angles
        dqkv = rotary_kernels.qkv_rotary_backward_triton(
            dq.flatten(0, 1), dk.flatten(0, 1), dv.flatten(0, 1),
            cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]), rotary.interleaved)
        return dqkv.view(*dq.shape[:2], -1), None, None
    if rotary is not None:
        assert angles is not None
        cos, sin = angles
        dq = apply_rotary(dq, cos, sin, rotary, inverse=True)
        dk = apply_rotary(dk, cos, sin, rotary, inverse=True)
    dqw: Optional[Tensor] = None
    dkw: Optional[Tensor] = None
    if norm_saved is not None:
        q_in, k_in, q_rstd, k_rstd, q_weight, k_weight = norm_saved
        shape = [layout.head_dim]
        dq_normed, dqw = rms_norm_backward(dq.contiguous(), q_in, q_rstd, q_weight, shape,
                                           True, need_norm_weights)
        dk_normed, dkw = rms_norm_backward(dk.contiguous(), k_in, k_rstd, k_weight, shape,
                                           True, need_norm_weights)
        assert dq_normed is not None and dk_normed is not None  # asked for: True above
        dq, dk = dq_normed, dk_normed
    dqkv = torch.cat([g.flatten(-2) for g in (dq, dk, dv)], -1)
    return dqkv, dqw, dkw
