"""The GEMMs of a linear layer, in high precision or FP8, shared by BasicLinear and fusions.

A linear layer's GEMMs take typed records (:class:`GemmForwardArgs`,
:class:`GemmBackwardArgs`): a fusion nests one in its own args, so a missing field is
an error when the record is built, in every precision.

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
from fusible.functional.parallel import TensorParallel
from fusible.quantization.casts.tensorwise import cast_tensorwise, tensor_amax
from fusible.quantization.format import Float8Format, to_format
from fusible.quantization.gemm import scaled_gemm
from fusible.quantization.tensor.float8_tensor import Float8Tensor, Fp8Able
from fusible.quantization.tensor.quantize import requantize

Tensor = torch.Tensor


@attrs.define
class GemmForwardArgs:
    """A linear layer's forward GEMM, ``y = x @ weight.T``.

    Attributes
    ----------
    input : Tensor or Float8Tensor
        ``x`` (a Float8Tensor when the stage before handed it over quantized).
    weight : Tensor or Float8Tensor
        The (local shard of the) weight parameter; a Float8Tensor for an FP8 parameter
        (``quantized_model_init``), which FP8 GEMMs read as it is.
    input_format, weight_format : Float8Format or None
        The FP8 formats of the GEMM's operands; None for a high-precision GEMM.
        ``input_format.columnwise``: keep the input's transposed copy for wgrad.
    parallel : TensorParallel
        How the layer is split over a process group (the layer's ``parallel``).
    """

    input: Fp8Able
    weight: Fp8Able  # a Float8Tensor for an FP8 parameter (quantized_model_init)
    input_format: Optional[Float8Format]
    weight_format: Optional[Float8Format]
    parallel: TensorParallel

    @property
    def fp8(self) -> bool:
        return self.input_format is not None


@attrs.define
class GemmBackwardArgs:
    """A linear layer's backward GEMMs: dgrad ``dy @ weight`` and wgrad ``dy.T @ x``.

    Attributes
    ----------
    grad_output : Tensor or Float8Tensor
        ``dy``.
    input, weight : Tensor, Float8Tensor or None
        As saved (:class:`LinearSaved`). None where the gradient that reads it is not
        needed. Under FP8 a high-precision weight is quantized by :func:`gemm_backward`
        itself, into the transposed copy dgrad reads, and dropped before the wgrad GEMM:
        the FP8 copy and the weight gradient are never alive together (the 70B FFN's W13
        at 2048 tokens: 0.44 GiB of peak).
    grad_format : Float8Format or None
        The FP8 format of ``dy``; None for high-precision GEMMs.
    need_grad_input, need_grad_weight : bool
        Which of dgrad and wgrad to compute.
    parallel : TensorParallel
    weight_format : Float8Format or None
        Under FP8, the format to quantize a high-precision weight to.
    weight_amax : Tensor or None
        The forward's absolute maximum of the weight (the same scale, bits and no second
        amax pass); None: computed.
    wgrad_dtype : torch.dtype or None
        The dtype of the weight gradient (float32 where it goes into ``main_grad``);
        None: ``dy``'s.
    """

    grad_output: Fp8Able
    input: Optional[Fp8Able]
    weight: Optional[Fp8Able]
    grad_format: Optional[Float8Format]
    need_grad_input: bool
    need_grad_weight: bool
    parallel: TensorParallel
    weight_format: Optional[Float8Format] = None
    weight_amax: Optional[Tensor] = None
    wgrad_dtype: Optional[torch.dtype] = None


@attrs.define
class LinearSaved:
    """BasicLinear's saved record: the input for wgrad (under FP8 its transposed copy
    only), the weight parameter itself for dgrad; None where not needed."""

    input: Optional[Fp8Able]
    weight: Optional[Tensor]
    weight_amax: Optional[Tensor] = None  # under FP8: the forward's, reused by the backward


def _wrong_record(args, record_type, where: str) -> TypeError:
    return TypeError(f"{where} takes a {record_type.__name__} (nest one in your args "
                     f"record), got {type(args).__name__}")


def tokens_2d(t: Tensor) -> Tensor:
    """View a (..., features) tensor as (tokens, features) for a GEMM."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def like_tokens(y2: Tensor, t: Tensor) -> Tensor:
    """View a (tokens, features) GEMM result with the leading dimensions of ``t``."""
    return y2 if t.dim() == 2 else y2.view(*t.shape[:-1], y2.shape[-1])


def linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T (+ bias)``; with a bias, one GEMM with the bias epilogue."""
    x2 = tokens_2d(x)
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
    """A bias's gradient: the sum of ``grad_output`` over all tokens."""
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
    """``(y, kept)``, ``kept`` being what :func:`~fusible.functional.linear_state.forward_aux`
    takes: in high precision the gathered input (column + sequence parallel) or None;
    under FP8 ``(the FP8 input, the weight's amax)`` (the backward quantizes the weight
    again with that amax: the same bits, without reading the weight for it).

    Tensor parallelism: column + sequence parallel all-gathers ``x`` first; row sums
    the output over the group (all-reduce, or reduce-scatter with sequence parallel),
    so a row-parallel ``bias`` would be added on every rank: callers refuse it.
    """
    if type(gemm) is not GemmForwardArgs:
        raise _wrong_record(gemm, GemmForwardArgs, "gemm_forward")
    x, weight, tp, fmt = gemm.input, gemm.weight, gemm.parallel, gemm.input_format
    if tp.active and tp.mode == "row" and bias is not None:
        raise ValueError(f"a row-parallel GEMM cannot add a bias before its reduction ({tp})")
    if fmt is None:
        x = parallel.all_gather(x, tp) if tp.gathers_input else x
        return (_reduce_output(linear_forward(x, weight, bias), tp),
                x if tp.gathers_input else None)
    if tp.gathers_input:
        x_q, lead = gather_fp8(x, tp, fmt), _gathered_lead(x, tp)
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
    return _reduce_output(y.view(*lead, y.shape[-1]), tp), (x_q, w_amax)


def gather_fp8(x: Tensor, tp: TensorParallel, fmt: Float8Format) -> Float8Tensor:
    """All-gather ``x`` along dim 0 in FP8 (``fmt``), as a 2-D Float8Tensor (tokens,
    features).

    Each rank casts its own tokens and the FP8 bytes are gathered (half of bf16's) with
    their scales, the bits of gathering in high precision and then quantizing: one scale
    per tensor is the group's (the absolute maxima all-reduced first); scales per token
    (or per tile of a token) are each rank's own; the transposed copy's scales per
    feature span the group's tokens, their maxima all-reduced first
    (:meth:`~fusible.quantization.scalings.base.Scaling.cast_gathered`). An FP8 ``x`` with its
    own scale is dequantized first.
    """
    if isinstance(x, Float8Tensor):
        x = x._dequantize_raw()
    parts = fmt.scaling.cast_gathered(tokens_2d(x), fmt.fp8_dtype, fmt.columnwise,
                                      lambda t: parallel.all_gather(t, tp),
                                      lambda t: parallel.all_reduce(t, tp, "max"),
                                      state=fmt.state)
    data, scale_inv, transpose, t_scale_inv = parts
    return Float8Tensor(data, scale_inv, x.dtype, transpose, transpose_scale_inv=t_scale_inv)


def _gathered_lead(x: Tensor, tp: TensorParallel) -> tuple:
    """The leading dimensions of ``x`` gathered along dim 0."""
    return (x.shape[0] * tp.world_size, *x.shape[1:-1])


def _reduce_output(y: Tensor, tp: TensorParallel) -> Tensor:
    """A row-parallel output summed over the group; others unchanged."""
    if not (tp.active and tp.mode == "row"):
        return y
    return parallel.sum_over_group(y, tp)


def _reduces_dgrad(tp: TensorParallel) -> bool:
    """Whether the dgrad is a partial sum, summed over the group (column parallel)."""
    return tp.active and tp.mode == "column"


def _start_dgrad_reduction(dx: Optional[Tensor], tp: TensorParallel) -> Optional[Tensor]:
    """Start summing a column-parallel dgrad (a partial sum) over the group; the caller
    issues the wgrad GEMM, which overlaps with it, then :func:`_finish`."""
    if dx is None or not _reduces_dgrad(tp):
        return dx
    return parallel.sum_over_group(dx, tp, wait=False)


def _finish(dx: Optional[Tensor], tp: TensorParallel) -> Optional[Tensor]:
    """The dgrad, once its reduction (if one was started) is done: no wait op otherwise
    (an op call of host time in every backward)."""
    return parallel.wait(dx) if dx is not None and _reduces_dgrad(tp) else dx


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
    """``(dgrad or None, wgrad or None)`` from the saved input and weight (under FP8,
    Float8Tensors with their transposed copies).

    ``accumulate_into`` is added to the dgrad (in the GEMM in high precision); not with
    a column-parallel ``tp``, whose dgrad is summed over the group afterwards. Row +
    sequence parallel all-gathers ``dy`` first. ``grad_scale`` multiplies ``dy`` inside
    both GEMMs (their epilogue in high precision, ``dy``'s FP8 scale under FP8): a
    constant scale after the layer, without a pass over ``dy``.
    """
    if type(args) is not GemmBackwardArgs:
        raise _wrong_record(args, GemmBackwardArgs, "gemm_backward")
    dy, x_saved, w_saved, tp = args.grad_output, args.input, args.weight, args.parallel
    need_dgrad, need_wgrad, fmt = args.need_grad_input, args.need_grad_weight, args.grad_format
    if _reduces_dgrad(tp) and accumulate_into is not None:
        raise ValueError(f"a column-parallel dgrad is summed over the group: it cannot "
                         f"accumulate into a local tensor ({tp})")
    if fmt is None:
        dy = parallel.all_gather(dy, tp) if tp.gathers_grad else dy
        dx = (linear_dgrad(dy, _needed(w_saved), accumulate_into, grad_scale)
              if need_dgrad else None)
        dx = _start_dgrad_reduction(dx, tp)
        dw = (linear_wgrad(dy, _needed(x_saved), grad_scale, args.wgrad_dtype)
              if need_wgrad else None)
        return _finish(dx, tp), dw
    if tp.gathers_grad:
        dy_q, lead = gather_fp8(dy, tp, fmt), _gathered_lead(dy, tp)
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
    dx = _start_dgrad_reduction(dx, tp)
    if need_wgrad:
        x_saved = cast(Float8Tensor, x_saved)  # under FP8 its transposed copy (LinearSaved)
        assert dy_q._transpose is not None and x_saved._transpose is not None  # columnwise
        dw = fp8_gemm(dy_q._transpose, _times(dy_q.transpose_scale_inv, grad_scale),
                      x_saved._transpose.t(), x_saved.transpose_scale_inv.t(), None,
                      args.wgrad_dtype or dy_q.dtype)
    return _finish(dx, tp), dw


def split_gemm_backward(args: GemmBackwardArgs) -> tuple:
    """``(dgrad record, wgrad record)``: a linear layer's backward GEMMs as two calls of
    :func:`gemm_backward` (a split backward). Under FP8 ``dy`` is quantized here, once,
    with both copies (the cast :func:`gemm_backward` would make), and both records read
    it: the wgrad record keeps its transposed copy and the saved input, the dgrad record
    the weight. The dgrad then has ``dy``'s tokens as one dimension: see
    :func:`like_tokens`."""
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


def _times(scale_inv: Tensor, grad_scale: float) -> Tensor:
    """The scales times ``grad_scale`` (float32: E8M0 scales have no products)."""
    return scale_inv if grad_scale == 1.0 else scale_inv.float() * grad_scale
