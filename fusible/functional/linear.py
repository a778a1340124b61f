"""The GEMMs of a linear layer, in high precision or FP8, shared by BasicLinear and fusions.

A linear layer's GEMMs take typed records
(:class:`~fusible.functional.linear_records.GemmForwardArgs`,
:class:`~fusible.functional.linear_records.GemmBackwardArgs`): a fusion nests one in its
own args, so a missing field is an error when the record is built, in every precision.

FP8 GEMMs use ``torch._scaled_mm`` with the layouts Hopper needs: the first
operand row-major, the second column-major. The forward reads ``x`` and
``weight.T`` (a view of the row-major weight); dgrad reads ``dy`` and the
weight's transposed copy; wgrad reads the transposed copies of ``dy`` and ``x``.
Each tensor is quantized once, with the copies the backward will need.
"""

from __future__ import annotations

from typing import Optional, cast

import attrs
import torch

from fusible.functional import parallel
from fusible.functional.linear_parallel import (finish_dgrad_reduction, gather_fp8,
                                                gathered_lead, reduce_output, reduces_dgrad,
                                                start_dgrad_reduction)
from fusible.functional.linear_records import GemmBackwardArgs, GemmForwardArgs
from fusible.quantization.casts.tensorwise import cast_tensorwise, tensor_amax
from fusible.quantization.format import Float8Format, to_format
from fusible.quantization.gemm import scaled_gemm
from fusible.quantization.tensor.float8_tensor import Float8Tensor, Fp8Able
from fusible.quantization.tensor.quantize import requantize

# What fusion authors import (docs/writing_a_fusion.md, "Helpers for fusion authors"); the
# rest serves BasicLinear, GroupedLinear and the benchmarks' timers.
__all__ = ["bias_grad", "gemm_backward", "gemm_forward", "like_tokens", "linear_forward",
           "split_dgrad", "split_gemm_backward", "tokens_2d"]

Tensor = torch.Tensor


def _wrong_record(args, record_type, where: str) -> TypeError:
    return TypeError(f"{where} takes a {record_type.__name__} (nest one in your args "
                     f"record), got {type(args).__name__}")


def tokens_2d(t: Tensor) -> Tensor:
    """View a (..., features) tensor as (tokens, features) for a GEMM.

    Parameters
    ----------
    t : Tensor
        Of shape (..., features).

    Returns
    -------
    Tensor
        ``t`` itself when 2-D, else a (tokens, features) view or copy.
    """
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def like_tokens(y2: Tensor, t: Tensor) -> Tensor:
    """View a (tokens, features) GEMM result with the leading dimensions of ``t``.

    Parameters
    ----------
    y2 : Tensor
        Of shape (tokens, features).
    t : Tensor
        The GEMM's input, whose leading dimensions ``y2`` gets.

    Returns
    -------
    Tensor
        Of shape (``*t.shape[:-1]``, features).
    """
    return y2 if t.dim() == 2 else y2.view(*t.shape[:-1], y2.shape[-1])


def linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                   residual: Optional[Tensor] = None) -> Tensor:
    """A linear layer's high-precision GEMM: ``x @ weight.T (+ bias) (+ residual)``.

    Parameters
    ----------
    x : Tensor
        Of shape (..., in_features).
    weight : Tensor
        (out_features, in_features).
    bias : Tensor, optional
        Without a residual, added in the GEMM's epilogue; with one, added after it.
    residual : Tensor, optional
        Of the output's shape: the GEMM's C matrix (``ForwardLinearBiasAdd``'s arithmetic).

    Returns
    -------
    Tensor
        Of shape (..., out_features).
    """
    x2 = tokens_2d(x)
    if residual is not None:
        y = torch.addmm(tokens_2d(residual), x2, weight.t())
        if bias is not None:
            y.add_(bias)
    else:
        y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
    return like_tokens(y, x)


def linear_dgrad(grad_output: Tensor, weight: Tensor,
                 accumulate_into: Optional[Tensor] = None, alpha: float = 1.0) -> Tensor:
    """``alpha * dy @ weight``; with ``accumulate_into``, ``that + alpha * dy @ weight``:
    one GEMM either way (``alpha`` in its epilogue, rounded once)."""
    dy2 = tokens_2d(grad_output)
    if accumulate_into is not None:
        dx = torch.addmm(tokens_2d(accumulate_into), dy2, weight, alpha=alpha)
    else:
        dx = _scaled_product(dy2, weight, alpha)
    return like_tokens(dx, grad_output)


def linear_wgrad(grad_output: Tensor, x: Tensor, alpha: float = 1.0,
                 out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``alpha * dy.T @ x`` summed over all tokens, in ``out_dtype`` (default ``dy``'s;
    float32 from 16-bit operands accumulates and rounds once, in float32)."""
    return _scaled_product(tokens_2d(grad_output).t(), tokens_2d(x), alpha, out_dtype)


def _scaled_product(a: Tensor, b: Tensor, alpha: float,
                    out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``alpha * a @ b`` in one GEMM: ``addmm`` with ``beta=0`` ignores its input. A
    float32 ``out_dtype`` from 16-bit operands: cuBLAS's float32 output on CUDA; on the
    CPU, which has no such GEMM, the operands are widened (exactly) first."""
    if out_dtype is not None and out_dtype != a.dtype:
        if not a.is_cuda:
            a, b = a.to(out_dtype), b.to(out_dtype)
        elif alpha == 1.0:
            return torch.mm(a, b, out_dtype=out_dtype)
        else:
            return torch.addmm(a.new_zeros((), dtype=out_dtype), a, b, out_dtype=out_dtype,
                               beta=0, alpha=alpha)
    if alpha == 1.0:
        return torch.mm(a, b)
    return torch.addmm(a.new_zeros(()), a, b, beta=0, alpha=alpha)


def bias_grad(grad_output: Tensor) -> Tensor:
    """A bias's gradient: the sum of ``grad_output`` over all tokens.

    Parameters
    ----------
    grad_output : Tensor
        Of shape (..., features).

    Returns
    -------
    Tensor
        Of shape (features,).
    """
    return tokens_2d(grad_output).sum(0)


def handed_in(x, fmt: Optional[Float8Format]) -> bool:
    """Whether the GEMM input ``x`` arrived already quantized to ``fmt``'s FP8 dtype and
    scaling.

    The stage then shares the caller's FP8 buffers: rather than return them (the
    custom-op boundary would copy them), it lets the caller save ``x`` itself.
    """
    return fmt is not None and fmt.matches(x)


def as_fp8(t: Tensor, fmt: Float8Format) -> Float8Tensor:
    """``t`` as a 2-D Float8Tensor in ``fmt``; a Float8Tensor handed over by the previous
    stage is used as it is (given a transposed copy if ``fmt`` wants one)."""
    return to_format(tokens_2d(t), fmt)


def fp8_gemm(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
             bias: Optional[Tensor], out_dtype: torch.dtype, fast_accum: bool = False) -> Tensor:
    """``(a * sa) @ (b * sb) (+ bias)``: ``a`` row-major FP8, ``b`` column-major FP8;
    the scales 0-d, one per row of ``a`` ((M, 1)) and one per column of ``b`` ((1, N);
    a 0-d one is expanded to match), or per block
    (:func:`fusible.quantization.gemm.scaled_gemm`).

    ``fast_accum`` lets Hopper accumulate in its faster, less precise FP8 mode; like
    TransformerEngine and torchao we take it for the forward GEMM only (gradients sum
    over many more products).
    """
    return scaled_gemm(a, a_scale_inv, b, b_scale_inv, bias, out_dtype, fast_accum)


def gemm_forward(gemm: GemmForwardArgs, bias: Optional[Tensor] = None):
    """A linear layer's forward GEMM, ``y = x @ weight.T (+ bias)``, in high precision or
    FP8 (the record's formats), with its tensor-parallel collectives.

    Tensor parallelism: column + sequence parallel all-gathers ``x`` first; row sums
    the output over the group (all-reduce, or reduce-scatter with sequence parallel),
    so a row-parallel ``bias`` would be added on every rank: callers refuse it.

    Parameters
    ----------
    gemm : GemmForwardArgs
        The record (:func:`~fusible.functional.linear_state.gemm_forward_args`).
    bias : Tensor, optional
        Added in the GEMM's epilogue.

    Returns
    -------
    tuple
        ``(y, kept)``, ``kept`` being what
        :func:`~fusible.functional.linear_state.forward_aux` takes: in high precision the
        gathered input (column + sequence parallel) or None; under FP8 ``(the FP8 input,
        the weight's amax)`` (the backward quantizes the weight again with that amax: the
        same bits, without reading the weight for it).

    Raises
    ------
    TypeError
        If ``gemm`` is not a GemmForwardArgs.
    ValueError
        For a bias on a row-parallel GEMM.
    """
    if type(gemm) is not GemmForwardArgs:
        raise _wrong_record(gemm, GemmForwardArgs, "gemm_forward")
    x, weight, tp, fmt = gemm.input, gemm.weight, gemm.parallel, gemm.input_format
    if tp.active and tp.mode == "row" and bias is not None:
        raise ValueError(f"a row-parallel GEMM cannot add a bias before its reduction ({tp})")
    if fmt is None:
        x = parallel.all_gather(x, tp) if tp.gathers_input else x
        return (reduce_output(linear_forward(x, weight, bias), tp),
                x if tp.gathers_input else None)
    if tp.gathers_input:
        x_q, lead = gather_fp8(x, tp, fmt), gathered_lead(x, tp)
    else:
        x_q, lead = as_fp8(x, fmt if not handed_in(x, fmt) else fmt.rowwise()), x.shape[:-1]
    w_format = gemm.weight_format
    assert w_format is not None  # an FP8 GEMM has both operands' formats
    if isinstance(weight, Float8Tensor):  # an FP8 parameter (quantized_model_init): as it is
        w_q = requantize(weight, w_format.fp8_dtype, False)
        w_data, w_scale_inv = w_q._data, w_q._scale_inv
        w_amax = weight._scale_inv  # unused: the backward reads the FP8 weight itself
    elif w_format.stateful:  # the state's scale; the backward casts again with its amax
        assert w_format.state is not None  # a stateful format is bound to its op's state
        w_amax = w_format.state[0].clone()
        w_data, w_scale_inv = w_format.scaling.cast(weight, w_format.fp8_dtype,
                                                    state=w_format.state)[:2]
    elif not w_format.per_tensor:  # its scaling's blocks; the backward casts again
        w_amax = None
        w_data, w_scale_inv = w_format.scaling.cast(weight, w_format.fp8_dtype)[:2]
    else:  # the cast's parts, used once: no Float8Tensor built around them
        w_amax = tensor_amax(weight)
        w_data, w_scale_inv = cast_tensorwise(weight, w_format.fp8_dtype, False, w_amax)[:2]
    # The input's dtype is the compute dtype (under torch.autocast the weight may be the
    # float32 parameter, quantized directly). Scales follow their data: the weight's
    # per-row ones become the column scales of its transpose.
    y = fp8_gemm(x_q._data, x_q._scale_inv, w_data.t(), w_scale_inv.t(), bias, x_q.dtype,
                 fast_accum=True)
    return reduce_output(y.view(*lead, y.shape[-1]), tp), (x_q, w_amax)


def _needed(t: Optional[Fp8Able]) -> Fp8Able:
    """A saved operand that a needed gradient reads (saved wherever one is)."""
    assert t is not None, "gemm_backward: a needed gradient's operand was not saved"
    return t


def _dgrad_weight(args: GemmBackwardArgs) -> tuple:
    """``(transposed FP8 copy, scale_inv)``: the weight as dgrad reads it under FP8 (the
    cast's parts, used once: no Float8Tensor built around them)."""
    w = _needed(args.weight)
    if isinstance(w, Float8Tensor):
        if w._transpose is None:
            raise ValueError("gemm_backward: an FP8 weight for dgrad needs its transposed copy")
        return w._transpose, w.transpose_scale_inv
    fmt = args.weight_format
    if fmt is None:
        raise ValueError("gemm_backward: FP8 dgrad of a high-precision weight needs "
                         "weight_format (the FP8 format to quantize it to)")
    if not fmt.per_tensor:  # the copy scaled per block of its own layout
        _, _, transpose, scale_inv = fmt.scaling.cast(w, fmt.fp8_dtype, False, True)
        return transpose, scale_inv
    transpose, scale_inv = cast_tensorwise(w, fmt.fp8_dtype, True, args.weight_amax,
                                           rowwise=False)
    return transpose, scale_inv


def gemm_backward(args: GemmBackwardArgs, accumulate_into: Optional[Tensor] = None,
                  grad_scale: float = 1.0):
    """A linear layer's backward GEMMs from the saved input and weight (under FP8,
    Float8Tensors with their transposed copies), with their tensor-parallel collectives
    (row + sequence parallel all-gathers ``dy`` first).

    Parameters
    ----------
    args : GemmBackwardArgs
        The record (:func:`~fusible.functional.linear_state.gemm_backward_args`, or one
        half of :func:`split_gemm_backward`).
    accumulate_into : Tensor, optional
        Added to the dgrad (in the GEMM in high precision); not with a column-parallel
        ``tp``, whose dgrad is summed over the group afterwards.
    grad_scale : float
        Multiplies ``dy`` inside both GEMMs (their epilogue in high precision, ``dy``'s
        FP8 scale under FP8): a constant scale after the layer, without a pass over ``dy``.

    Returns
    -------
    tuple
        ``(dgrad or None, wgrad or None)``, None where the record says it is not needed.

    Raises
    ------
    TypeError
        If ``args`` is not a GemmBackwardArgs.
    ValueError
        For ``accumulate_into`` with a column-parallel dgrad.
    """
    if type(args) is not GemmBackwardArgs:
        raise _wrong_record(args, GemmBackwardArgs, "gemm_backward")
    dy, x_saved, w_saved, tp = args.grad_output, args.input, args.weight, args.parallel
    need_dgrad, need_wgrad, fmt = args.need_grad_input, args.need_grad_weight, args.grad_format
    if reduces_dgrad(tp) and accumulate_into is not None:
        raise ValueError(f"a column-parallel dgrad is summed over the group: it cannot "
                         f"accumulate into a local tensor ({tp})")
    if fmt is None:
        dy = parallel.all_gather(dy, tp) if tp.gathers_grad else dy
        dx = (linear_dgrad(dy, _needed(w_saved), accumulate_into, grad_scale)
              if need_dgrad else None)
        dx = start_dgrad_reduction(dx, tp)
        dw = (linear_wgrad(dy, _needed(x_saved), grad_scale, args.wgrad_dtype)
              if need_wgrad else None)
        return finish_dgrad_reduction(dx, tp), dw
    if tp.gathers_grad:
        dy_q, lead = gather_fp8(dy, tp, fmt), gathered_lead(dy, tp)
    else:
        dy_q, lead = as_fp8(dy, fmt), dy.shape[:-1]
    dx = dw = None
    if need_dgrad:
        w_t, w_scale_inv = _dgrad_weight(args)
        dx = fp8_gemm(dy_q._data, _times(dy_q._scale_inv, grad_scale), w_t.t(),
                      w_scale_inv.t(), None, dy_q.dtype)
        del w_t  # freed before the wgrad GEMM allocates the weight gradient
        dx = dx.view(*lead, dx.shape[-1])
        if accumulate_into is not None:
            dx = dx + accumulate_into.reshape(dx.shape)  # dy may come flat
    dx = start_dgrad_reduction(dx, tp)
    if need_wgrad:
        x_saved = cast(Float8Tensor, x_saved)  # under FP8 its transposed copy (LinearSaved)
        assert dy_q._transpose is not None and x_saved._transpose is not None  # columnwise
        dw = fp8_gemm(dy_q._transpose, _times(dy_q.transpose_scale_inv, grad_scale),
                      x_saved._transpose.t(), x_saved.transpose_scale_inv.t(), None,
                      args.wgrad_dtype or dy_q.dtype)
    return finish_dgrad_reduction(dx, tp), dw


def split_gemm_backward(args: GemmBackwardArgs) -> tuple:
    """A linear layer's backward GEMMs as two calls of :func:`gemm_backward` (a split
    backward, ``fusible.split_backward()``).

    Under FP8 ``dy`` is quantized here, once, with both copies (the cast
    :func:`gemm_backward` would make), and both records read it: the wgrad record keeps
    its transposed copy and the saved input, the dgrad record the weight. The dgrad then
    has ``dy``'s tokens as one dimension: see :func:`like_tokens`.

    Parameters
    ----------
    args : GemmBackwardArgs
        The one-call record.

    Returns
    -------
    tuple
        ``(dgrad record, wgrad record)``, both GemmBackwardArgs.

    Raises
    ------
    TypeError
        If ``args`` is not a GemmBackwardArgs.
    ValueError
        Where ``dy`` is all-gathered (row + sequence parallel): the two GEMMs cannot share
        the gather.
    """
    if type(args) is not GemmBackwardArgs:
        raise _wrong_record(args, GemmBackwardArgs, "split_gemm_backward")
    if args.parallel.gathers_grad:
        raise ValueError(f"a split backward cannot share dy's all-gather between the dgrad "
                         f"and wgrad GEMMs ({args.parallel})")
    dy = args.grad_output
    if args.grad_format is not None and args.need_grad_weight:
        dy = as_fp8(dy, args.grad_format)
    dgrad = attrs.evolve(args, grad_output=dy, input=None, need_grad_weight=False)
    wgrad = attrs.evolve(args, grad_output=dy, weight=None, weight_amax=None,
                         need_grad_input=False)
    return dgrad, wgrad


def split_dgrad(dgrad: GemmBackwardArgs, grad_output: Tensor, **kwargs) -> Optional[Tensor]:
    """The dgrad of a split backward with the leading dimensions of the layer's
    ``grad_output``: its tokens may have come flat (FP8), and dim 0 is split over the group
    where the dgrad was reduce-scattered (column + sequence parallel).

    Parameters
    ----------
    dgrad : GemmBackwardArgs
        :func:`split_gemm_backward`'s dgrad record.
    grad_output : Tensor
        The layer's ``dy`` as it came (its leading dimensions).
    **kwargs
        Passed to :func:`gemm_backward` (``accumulate_into``, ``grad_scale``).

    Returns
    -------
    Tensor or None
        None where the record needs no dgrad.
    """
    dx, _ = gemm_backward(dgrad, **kwargs)
    if dx is None:
        return None
    lead, tp = tuple(grad_output.shape[:-1]), dgrad.parallel
    if reduces_dgrad(tp) and tp.sequence_parallel:
        lead = (lead[0] // tp.world_size, *lead[1:])
    return dx.view(*lead, dx.shape[-1])


def _times(scale_inv: Tensor, grad_scale: float) -> Tensor:
    """The scales times ``grad_scale`` (float32: E8M0 scales have no products)."""
    return scale_inv if grad_scale == 1.0 else scale_inv.float() * grad_scale
