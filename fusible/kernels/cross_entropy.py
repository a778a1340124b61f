"""Cross-entropy over one chunk of logits in one kernel (the formulas:
:mod:`fusible.functional.cross_entropy`): each token's log-sum-exp, loss and, when a
gradient is wanted, the logits' gradient written over the logits themselves (or into a
buffer of their shape), so a chunk costs two reads and one write of its 16-bit logits
instead of a chain of float32 elementwise passes.

One program per token: a first pass over the vocabulary keeps the running maximum, the
sum of exponentials under it and (label smoothing) the logits' sum, in float32; a second
writes the gradient. Given the log-sum-exp (a backward that made the logits again), the
first pass is skipped.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusible.kernels import jit, require_triton, tl, triton

_BLOCK = 4096  # vocabulary entries per step of a program's loop (16 KiB of float32)


@jit
def _row_statistics(z_row, V, BLOCK: tl.constexpr, SMOOTH: tl.constexpr):
    """``(lse, sum)`` of a row of ``V`` logits (``sum`` 0 without ``SMOOTH``)."""
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    total = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(z, 0))
        # while every logit so far is -inf, new_m is too: exp(-inf - -inf) is NaN, so the
        # rescale and this block's terms are guarded (they are 0)
        empty = new_m == float("-inf")
        rescale = tl.where(empty, 0.0, tl.exp(m - new_m))
        s = s * rescale + tl.sum(tl.where(empty, 0.0, tl.exp(z - new_m)), 0)
        m = new_m
        if SMOOTH:
            total += tl.sum(tl.where(cols < V, z, 0.0), 0)
    return m + tl.log(s), total


@jit
def _chunk_cross_entropy_kernel(z_ptr, dz_ptr, labels_ptr, scale_ptr, loss_ptr, lse_ptr, V,
                                ignore_index, smoothing, z_loss, LSE_GIVEN: tl.constexpr,
                                GRAD: tl.constexpr, SMOOTH: tl.constexpr, ZLOSS: tl.constexpr,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * V
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    if LSE_GIVEN:
        lse = tl.load(lse_ptr + row)
    else:
        lse, total = _row_statistics(z_row, V, BLOCK, SMOOTH)
        # an out-of-range label reads entry 0 (check_labels reports it on the device)
        picked = tl.load(z_row + tl.where((label >= 0) & (label < V), label, 0)).to(tl.float32)
        loss = (1.0 - smoothing) * (lse - picked)
        if SMOOTH:
            loss += smoothing * (lse - total / V)
        if ZLOSS:
            loss += z_loss * lse * lse
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        tl.store(lse_ptr + row, lse)
    if GRAD:
        scale = tl.where(valid, tl.load(scale_ptr + row), 0.0)
        softmax_scale = scale
        if ZLOSS:
            softmax_scale = scale * (1.0 + 2.0 * z_loss * lse)
        dz_row = dz_ptr + row * V
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(z_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) * softmax_scale
            if SMOOTH:
                g -= (smoothing / V) * scale
            g = tl.where(cols == label, g - (1.0 - smoothing) * scale, g)
            g = tl.where(valid, g, 0.0)  # an ignored token: 0, even where its lse is -inf
            tl.store(dz_row + cols, g.to(dz_row.dtype.element_ty), mask=cols < V)


def chunk_cross_entropy_triton(z: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                               smoothing: float, z_loss: float, losses: torch.Tensor,
                               lse: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                               dz: Optional[torch.Tensor] = None, lse_given: bool = False,
                               block: int = _BLOCK) -> None:
    """Each token's loss and log-sum-exp into ``losses`` and ``lse`` (float32, contiguous;
    with ``lse_given`` ``lse`` is read and ``losses`` untouched) and, with ``row_scale``
    (float32, each token's factor), the gradient of ``sum(row_scale * loss)`` at ``z`` into
    ``dz`` (``z`` itself allowed), rounded to its dtype. ``z`` (tokens, V) contiguous."""
    require_triton("chunk_cross_entropy")
    tokens, vocab = z.shape
    if not tokens:
        return
    grad = row_scale is not None
    assert not grad or (dz is not None and dz.is_contiguous() and dz.shape == z.shape)
    _chunk_cross_entropy_kernel[(tokens,)](
        z, dz if grad else z, labels, row_scale if grad else lse, losses, lse, vocab,
        ignore_index, float(smoothing), float(z_loss), LSE_GIVEN=lse_given, GRAD=grad,
        SMOOTH=bool(smoothing), ZLOSS=bool(z_loss),
        BLOCK=min(block, triton.next_power_of_2(vocab)), num_warps=8)
