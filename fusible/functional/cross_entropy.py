"""Cross-entropy over a vocabulary, chunked over the tokens: the logits of a chunk are made
(by the LM head's GEMM, or read from the given logits), reduced to each token's loss and
log-sum-exp, and, where gradients are wanted, turned into the chunk's logit gradient at once,
so that no tensor of all the tokens' logits in float32 ever exists.

Per token with logits ``z`` (float32), label ``y``, vocabulary ``V``, label smoothing ``e``
and z-loss weight ``l`` (PaLM's ``l * lse**2``, which keeps the log-partition near 0)::

    lse  = logsumexp(z)
    loss = (1 - e) * (lse - z[y]) + e * (lse - mean(z)) + l * lse**2
    dloss/dz = softmax(z) * (1 + 2 l lse) - (1 - e) * onehot(y) - e / V

which is ``F.cross_entropy(z, y, label_smoothing=e)`` plus the z-loss. Tokens whose label
is ``ignore_index`` count for nothing (loss and gradient 0); ``reduction="mean"`` divides
by the number of the others (NaN when there is none, as ``F.cross_entropy``).
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.functional.head_gemms import HeadFp8, HeadOperands
from fusible.kernels import cross_entropy as ce_kernels
from fusible.kernels import triton_can_run

Tensor = torch.Tensor

# What fusions may import (the rest serves fusible.ops.CrossEntropy)
__all__ = ["HeadFp8", "LossOptions", "linear_cross_entropy_backward",
           "linear_cross_entropy_forward"]

# Elements of one chunk's logits (512 MiB in bf16): the default chunk of tokens is this
# over the vocabulary size. On CUDA the chunk's logits (their gradient written over them)
# are its transient memory; the PyTorch path adds float32 copies. Smaller chunks cost
# time: each adds a pass over the weight's gradient (vocab, hidden) to accumulate into it.
_CHUNK_ELEMENTS = 2 ** 28
# A 16-bit weight gradient is summed in its own dtype over at most this many chunks (one
# rounding per chunk); over more, in float32 (a float32 copy of the weight for the length
# of the head's step), then rounded once: the error of a sum rounded per chunk grows with
# their number (about 50 dB against float64 for one chunk, 38 for 128)
_ROUNDED_CHUNKS = 8
REDUCTIONS = ("mean", "sum", "none")


@attrs.frozen
class LossOptions:
    """The cross-entropy's options (the formulas: the module notes).

    Attributes
    ----------
    ignore_index : int
        Tokens with this label count for nothing.
    reduction : {"mean", "sum", "none"}
    label_smoothing : float
        ``e`` in [0, 1].
    z_loss : float
        ``l`` >= 0.
    """

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0


def check_options(where: str, options: LossOptions) -> None:
    """Raise ValueError naming ``where`` for an option outside its domain (the types and
    lower bounds are the op's attribute checks)."""
    if options.label_smoothing > 1.0:
        raise ValueError(f"{where}: label_smoothing must be in [0, 1], got "
                         f"{options.label_smoothing}")


def default_chunk(vocab: int) -> int:
    """Tokens per chunk when none is given: at most 2**28 logits (512 MiB in bf16)."""
    return max(1, _CHUNK_ELEMENTS // vocab)


def chunks(tokens: int, chunk: int) -> list:
    """``(start, stop)`` of each chunk of the tokens."""
    return [(lo, min(lo + chunk, tokens)) for lo in range(0, tokens, chunk)]


def wgrad_sum_dtype(dtype: torch.dtype, tokens: int, chunk: int) -> torch.dtype:
    """The dtype the weight gradient (of ``dtype``) is summed in over the chunks."""
    if dtype in (torch.bfloat16, torch.float16) and -(-tokens // chunk) > _ROUNDED_CHUNKS:
        return torch.float32
    return dtype


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loss's dtype: float32 for 16-bit logits (the losses are summed in float32, as
    Hugging Face's models upcast the logits), else the logits' own."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def check_labels(labels: Tensor, vocab: int, options: LossOptions, where: str) -> None:
    """Asynchronously (on the device) that every label is a class or ``ignore_index``."""
    in_range = (labels >= 0) & (labels < vocab)
    torch._assert_async((in_range | (labels == options.ignore_index)).all(),
                        f"{where}: every label must be in [0, {vocab}) or ignore_index "
                        f"({options.ignore_index})")


def counted(labels: Tensor, options: LossOptions, dtype: torch.dtype) -> Tensor:
    """Each token's weight in the sum: 1 where its label counts, else 0."""
    return (labels != options.ignore_index).to(dtype)


def chunk_losses(z: Tensor, labels: Tensor, options: LossOptions) -> tuple:
    """``(loss, lse)`` per token of a chunk: ``z`` (tokens, V) in float32 or float64."""
    valid = labels != options.ignore_index
    lse = torch.logsumexp(z, -1)
    picked = z.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    e = options.label_smoothing
    loss = (1.0 - e) * (lse - picked)
    if e:
        loss = loss + e * (lse - z.mean(-1))
    if options.z_loss:
        loss = loss + options.z_loss * lse.square()
    return torch.where(valid, loss, 0.0), lse


def chunk_logits_grad(z: Tensor, lse: Tensor, labels: Tensor, options: LossOptions,
                      row_scale: Tensor) -> Tensor:
    """The gradient of ``sum(row_scale * loss)`` at the chunk's logits ``z`` (float32 or
    float64), from the ``lse`` :func:`chunk_losses` gave."""
    valid = labels != options.ignore_index
    scale = torch.where(valid, row_scale.to(z.dtype), 0.0)  # per row: 0 where ignored
    softmax_scale = scale * (1.0 + 2.0 * options.z_loss * lse) if options.z_loss else scale
    # one (tokens, V) buffer, updated in place: each pass over it is a pass over memory
    grad = torch.sub(z, lse.unsqueeze(-1)).exp_().mul_(softmax_scale.unsqueeze(-1))
    e = options.label_smoothing
    if e:
        grad.sub_((e / z.shape[-1]) * scale.unsqueeze(-1))
    picked = (-(1.0 - e) * scale).unsqueeze(-1)
    grad = grad.scatter_add_(-1, torch.where(valid, labels, 0).unsqueeze(-1), picked)
    return grad.masked_fill_(~valid.unsqueeze(-1), 0.0)  # an ignored token: 0, even at lse -inf


def _kernel_ok(z: Tensor, *others: Tensor) -> bool:
    return triton_can_run(z) and z.is_contiguous() and all(t.is_contiguous() for t in others)


def chunk_forward(z: Tensor, labels: Tensor, options: LossOptions, losses: Tensor,
                  lse: Tensor, row_scale: Optional[Tensor] = None,
                  in_place: bool = False) -> Optional[Tensor]:
    """A chunk's losses and log-sum-exps into ``losses`` and ``lse`` (the chunk's slices of
    the float32 or float64 buffers) and, with ``row_scale``, the gradient of
    ``sum(row_scale * loss)`` at ``z`` returned, rounded to ``z``'s dtype (with
    ``in_place``, written over ``z`` where the Triton kernel runs). One kernel on CUDA
    (:mod:`fusible.kernels.cross_entropy`), else :func:`chunk_losses` and
    :func:`chunk_logits_grad` on ``z`` upcast."""
    if _kernel_ok(z, labels, losses, lse) and losses.dtype == torch.float32:
        dz = None if row_scale is None else z if in_place else torch.empty_like(z)
        ce_kernels.chunk_cross_entropy_triton(
            z, labels, options.ignore_index, options.label_smoothing, options.z_loss, losses,
            lse, row_scale, dz)
        return dz
    acc = z.to(losses.dtype)
    chunk_loss, chunk_lse = chunk_losses(acc, labels, options)
    losses.copy_(chunk_loss)
    lse.copy_(chunk_lse)
    if row_scale is None:
        return None
    return chunk_logits_grad(acc, chunk_lse, labels, options, row_scale).to(z.dtype)


def chunk_grad(z: Tensor, labels: Tensor, options: LossOptions, lse: Tensor,
               row_scale: Tensor, out: Tensor) -> None:
    """The gradient of ``sum(row_scale * loss)`` at a chunk's logits ``z`` into ``out``
    (``z``'s shape, rounded to its dtype; ``z`` itself allowed), from the forward's
    log-sum-exp ``lse``."""
    if _kernel_ok(z, labels, lse, out) and lse.dtype == torch.float32:
        ce_kernels.chunk_cross_entropy_triton(
            z, labels, options.ignore_index, options.label_smoothing, options.z_loss, lse,
            lse, row_scale.contiguous(), out, lse_given=True)
        return
    out.copy_(chunk_logits_grad(z.to(lse.dtype), lse, labels, options, row_scale))


def reduce_losses(losses: Tensor, labels: Tensor, options: LossOptions) -> Tensor:
    """The reduction of the per-token losses (``labels``' shape for ``"none"``)."""
    if options.reduction == "none":
        return losses.reshape(labels.shape)
    total = losses.sum()
    if options.reduction == "mean":
        return total / counted(labels, options, losses.dtype).sum()
    return total


def unit_row_scale(labels: Tensor, options: LossOptions, dtype: torch.dtype) -> Tensor:
    """Each token's factor in the reduced loss (mean: 1 / the counted tokens; sum: 1), in
    ``dtype`` (the losses')."""
    ones = torch.ones(labels.shape, dtype=dtype, device=labels.device)
    if options.reduction == "mean":
        return ones / counted(labels, options, dtype).sum()
    return ones


def grad_row_scale(grad_output: Tensor, labels: Tensor, options: LossOptions,
                   dtype: torch.dtype) -> Tensor:
    """Each token's factor in the backward, in ``dtype`` (the losses'): the output
    gradient spread over the tokens as the reduction spread the loss."""
    if options.reduction == "none":
        return grad_output.reshape(-1).to(dtype)
    return unit_row_scale(labels, options, dtype) * grad_output.to(dtype)


def linear_cross_entropy_forward(x: Tensor, weight: Tensor, labels: Tensor,
                                 options: LossOptions, chunk: int, need_grad_input: bool,
                                 need_grad_weight: bool, gradients_now: bool,
                                 fp8: Optional[HeadFp8] = None,
                                 grad_weight_dtype: Optional[torch.dtype] = None) -> tuple:
    """The loss of ``x @ weight.T`` against ``labels``, a chunk of tokens at a time.

    Parameters
    ----------
    x : Tensor
        (tokens, in_features).
    weight : Tensor
        (vocab, in_features), ``x``'s dtype.
    labels : Tensor
        (tokens,) integers.
    options : LossOptions
    chunk : int
        Tokens per chunk.
    need_grad_input, need_grad_weight : bool
        Which gradients ``gradients_now`` makes.
    gradients_now : bool
        Make the gradients for an output gradient of 1 now, from each chunk's logits
        (a reduced loss: the backward then only scales them).
    fp8 : HeadFp8, optional
        Run the logits' and the hidden states' gradient's GEMMs in FP8
        (:mod:`fusible.functional.head_gemms`).
    grad_weight_dtype : torch.dtype, optional
        The weight gradient's dtype, which its sum over the chunks is kept in (None: the
        weight's).

    Returns
    -------
    tuple
        ``(loss, lse, dx, dw)``: the loss reduced by ``options.reduction`` (per token for
        ``"none"``) and each token's log-sum-exp (float32 for 16-bit ``x``), and with
        ``gradients_now`` the gradients (``dx`` float32 for 16-bit ``x``, ``dw`` in
        ``grad_weight_dtype``, zeros without tokens), else None.
    """
    check_labels(labels, weight.shape[0], options, "LinearCrossEntropy")
    acc = loss_dtype(x.dtype)
    losses = x.new_empty(labels.shape, dtype=acc)
    lse = torch.empty_like(losses)
    scale = unit_row_scale(labels, options, acc) if gradients_now else None
    dx = x.new_empty(x.shape, dtype=acc) if gradients_now and need_grad_input else None
    dw = None
    dw_dtype = grad_weight_dtype or weight.dtype
    sum_dtype = wgrad_sum_dtype(dw_dtype, x.shape[0], chunk)
    gemms = HeadOperands(x, weight, fp8, dx is not None)
    for lo, hi in chunks(x.shape[0], chunk):
        z = gemms.logits(lo, hi)  # rounded to x's dtype, as a GEMM's output
        dz = chunk_forward(z, labels[lo:hi], options, losses[lo:hi], lse[lo:hi],
                           None if scale is None else scale[lo:hi], in_place=True)
        if dz is not None:
            if dx is not None:  # float32: the backward scales it, then rounds
                dx[lo:hi] = gemms.dgrad(dz, acc)
            if need_grad_weight:
                dw = gemms.wgrad(dw, dz, lo, hi, sum_dtype)
        del z, dz  # before the next chunk's logits: one chunk's alive at a time, not two
    if gradients_now and need_grad_weight and dw is None:  # no token
        dw = torch.zeros(weight.shape, dtype=dw_dtype, device=weight.device)
    if dw is not None:
        dw = dw.to(dw_dtype)
    return reduce_losses(losses, labels, options), lse, dx, dw


def linear_cross_entropy_backward(grad_output: Tensor, x: Tensor, weight: Tensor,
                                  labels: Tensor, lse: Tensor, options: LossOptions,
                                  chunk: int, need_grad_input: bool,
                                  need_grad_weight: bool,
                                  fp8: Optional[HeadFp8] = None,
                                  grad_weight_dtype: Optional[torch.dtype] = None) -> tuple:
    """The gradients of :func:`linear_cross_entropy_forward`'s reduced loss, each
    chunk's logits made again from ``x`` and ``weight``.

    Parameters
    ----------
    grad_output : Tensor
        The reduced loss's gradient (a number per token for ``reduction="none"``).
    x, weight, labels, options, chunk, fp8, grad_weight_dtype
        As the forward's.
    lse : Tensor
        The forward's log-sum-exp per token.
    need_grad_input, need_grad_weight : bool

    Returns
    -------
    tuple
        ``(dx, dw)``: ``dx`` in ``x``'s dtype, ``dw`` in ``grad_weight_dtype``; None where
        not needed.
    """
    scale = grad_row_scale(grad_output, labels, options, lse.dtype)
    dx = torch.empty_like(x) if need_grad_input else None
    dw = None
    dw_dtype = grad_weight_dtype or weight.dtype
    sum_dtype = wgrad_sum_dtype(dw_dtype, x.shape[0], chunk)
    gemms = HeadOperands(x, weight, fp8, dx is not None)
    for lo, hi in chunks(x.shape[0], chunk):
        dz = gemms.logits(lo, hi)
        chunk_grad(dz, labels[lo:hi], options, lse[lo:hi], scale[lo:hi], out=dz)
        if dx is not None:
            dx[lo:hi] = gemms.dgrad(dz, x.dtype)
        if need_grad_weight:
            dw = gemms.wgrad(dw, dz, lo, hi, sum_dtype)
        del dz  # before the next chunk's logits: one chunk's alive at a time, not two
    if need_grad_weight and dw is None:
        dw = torch.zeros(weight.shape, dtype=dw_dtype, device=weight.device)
    return dx, None if dw is None else dw.to(dw_dtype)
