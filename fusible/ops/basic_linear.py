"""BasicLinear: ``y = x @ weight.T`` over any number of leading dimensions."""

from __future__ import annotations

import math
from typing import Optional

import attrs
import torch
from torch import nn

from fusible import distributed
from fusible.distributed import NOT_PARALLEL, TensorParallel
from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult
from fusible.ops.linear_math import (as_fp8, gemm_backward, gemm_forward, handed_in_fp8,  # noqa: F401
                                     like_tokens, linear_dgrad, linear_forward, linear_wgrad,
                                     tokens_2d, transposed_only)
from fusible.quantization.float8_tensor import Fp8Able, quantize_raw

Tensor = torch.Tensor


@attrs.define
class LinearForwardArgs:
    input: Fp8Able
    weight: Tensor
    fp8_dtype: Optional[torch.dtype]  # None: high precision
    keep_input_t: bool                # FP8: keep the input's transposed copy (for wgrad)
    tp: TensorParallel = NOT_PARALLEL


@attrs.define
class LinearBackwardArgs:
    grad_output: Fp8Able
    input: Optional[Fp8Able]
    weight: Optional[Fp8Able]
    grad_fp8_dtype: Optional[torch.dtype]  # None: high precision
    need_grad_input: bool
    need_grad_weight: bool
    tp: TensorParallel = NOT_PARALLEL


def parallel_refusal(linear: "BasicLinear", modes=("",), why: str = "") -> "bool | str":
    """True when a fusion covering ``linear`` handles its tensor-parallel mode (one of
    ``modes``; ``""`` for none), else the reason for the plan (``why``, or a default)."""
    tp = linear.tp
    if not tp.active or tp.mode in modes:
        return True
    return why or (f"this fusion does not run BasicLinear's collectives "
                   f"(tensor_parallel_mode={tp.mode!r}, sequence_parallel="
                   f"{tp.sequence_parallel}, world size {tp.world_size})")


class BasicLinear(BasicOperation):
    """``y = x @ weight.T`` with ``weight`` of shape (out_features, in_features).

    Parameters
    ----------
    in_features, out_features : int
        Sizes of the last dimension of the input and of the output.
    tensor_parallel_mode : {None, "column", "row"}
        Split the weight over ``tensor_parallel_group``: "column" keeps rows
        ``rank*out/ws ...`` of it (this rank's slice of the output features), "row"
        columns ``rank*in/ws ...`` (the input is this rank's slice of the features).
        Sizes stay global; ``weight`` is the local shard.
    tensor_parallel_group : torch.distributed.ProcessGroup, optional
        The group; the default group when None.
    sequence_parallel : bool
        Tokens (dim 0) are split over the group outside this layer: column
        all-gathers its input (and reduce-scatters its dgrad), row reduce-scatters
        its output (and all-gathers its incoming gradient). Without it, column
        all-reduces its dgrad and row all-reduces its output.
    device, dtype
        Where and in which dtype to create ``weight``.

    Notes
    -----
    Saves ``(input, weight)`` for backward: the input only when the weight
    needs a gradient (wgrad), the weight only when the input does (dgrad); with
    column + sequence_parallel, the gathered input.
    Initialised like ``torch.nn.Linear`` of the global sizes.
    """

    saved_fields = ("input", "weight")
    fp8_input_consumer = fp8_grad_consumer = True
    param_names = ("weight",)
    fwd_args_type = LinearForwardArgs
    bwd_args_type = LinearBackwardArgs

    def __init__(self, in_features: int, out_features: int, *, tensor_parallel_mode=None,
                 tensor_parallel_group=None, sequence_parallel: bool = False, device=None,
                 dtype=None):
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"BasicLinear needs positive sizes, got {in_features=}, "
                             f"{out_features=}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        if sequence_parallel and tensor_parallel_mode is None:
            raise ValueError(f"{self.describe()}: sequence_parallel=True needs "
                             f"tensor_parallel_mode 'column' or 'row'")
        self.tensor_parallel_mode, self.sequence_parallel = tensor_parallel_mode, sequence_parallel
        self.tp = distributed.tensor_parallel(self.describe(), tensor_parallel_mode,
                                              sequence_parallel, tensor_parallel_group)
        self.local_in, self.local_out = local_linear_sizes(self)
        self.weight = nn.Parameter(torch.empty(self.local_out, self.local_in, device=device,
                                               dtype=dtype))
        init_linear_weight(self.weight, self)

    @property
    def tensor_parallel_group(self):
        """The process group the weight is split over (None when not parallel)."""
        return distributed.group_of(self.tp)

    def describe(self) -> str:
        tp = getattr(self, "tp", NOT_PARALLEL)
        mode = (f", tensor_parallel_mode={tp.mode!r}, sequence_parallel={tp.sequence_parallel}"
                if tp.mode else "")
        return (f"BasicLinear(in_features={self.in_features}, out_features={self.out_features}"
                f"{mode})")

    def diagram_label(self) -> str:
        tp = self.tp
        mode = f"\n{tp.mode}{' + SP' if tp.sequence_parallel else ''} /{tp.world_size}"
        return f"{self.in_features} \u2192 {self.out_features}" + (mode if tp.mode else "")

    def validate(self, shape, dtype, device, extra_inputs=()):
        if not shape:
            raise ValueError(f"{self.describe()} got a 0-d input; it needs (..., "
                             f"{self.in_features})")
        if shape[-1] != self.local_in:
            shard = " (this rank's shard)" if self.local_in != self.in_features else ""
            raise ValueError(f"{self.describe()} got input with last dimension {shape[-1]}; "
                             f"expected {self.local_in}{shard}")
        self._check_param("weight", self.weight, dtype, device)
        return (*parallel_tokens(self, shape), self.local_out)

    def validate_fp8(self, shape) -> None:
        """FP8 GEMMs (Hopper's) need every dimension divisible by 16."""
        tokens = math.prod(shape[:-1]) * (self.tp.world_size if self.tp.gathers_input else 1)
        if self.local_in % 16 or self.local_out % 16 or tokens % 16:
            raise ValueError(f"{self.describe()} under an FP8 recipe needs in_features, "
                             f"out_features (of this rank's shard: {self.local_in}, "
                             f"{self.local_out}) and the number of tokens divisible by 16, got "
                             f"{tokens} tokens; pad the tokens or run it outside "
                             f"fusible.autocast")

    def forward_args(self, input, params, extra_inputs, ctxs):
        return LinearForwardArgs(input, params[0], *fp8_forward_flags(ctxs[0]), self.tp)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        y, x_q = gemm_forward(args.input, args.weight, None, args.fp8_dtype, args.keep_input_t,
                              args.tp)
        return ForwardResult(y, (), linear_aux(args, x_q))

    def save_for_backward(self, args, result, ctxs):
        save_linear(ctxs[0], args, result.aux)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return linear_backward_args(ctxs[0], grad_output, self.tp)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(*linear_backward(args))

    def communication(self, direction, needs=None):
        tp = self.tp
        if not tp.active or (direction == "backward" and needs is not None
                             and not needs.input and tp.mode == "column"):
            return ()  # a column layer's backward communicates only its dgrad
        sp, ws = tp.sequence_parallel, tp.world_size
        reduce = "reduce-scatter" if sp else "all-reduce"
        if direction == "forward":
            return ((("before", f"all-gather input /{ws}"),) if tp.mode == "column" and sp
                    else (("after", f"{reduce} output /{ws}"),) if tp.mode == "row" else ())
        return ((("before", f"all-gather grad /{ws}"),) if tp.mode == "row" and sp
                else (("after", f"{reduce} dgrad /{ws}"),) if tp.mode == "column" else ())

    def extra_repr(self) -> str:
        return self.describe()[len("BasicLinear("):-1]


def local_linear_sizes(op) -> tuple:
    """``(local in_features, local out_features)``: the weight shard's shape, reversed."""
    tp, name = op.tp, op.describe()
    if tp.mode == "column":
        return op.in_features, distributed.shard_size(name, "out_features", op.out_features, tp)
    if tp.mode == "row":
        return distributed.shard_size(name, "in_features", op.in_features, tp), op.out_features
    return op.in_features, op.out_features


def init_linear_weight(weight: Tensor, linear: "BasicLinear") -> None:
    """``torch.nn.Linear``'s initialisation (kaiming uniform, a=sqrt(5)) of the full
    weight, of which a parallel layer keeps its shard: with the same seed on every rank,
    the shards are slices of the weight a single-GPU layer would get."""
    gain = math.sqrt(2.0 / (1 + 5))
    bound = math.sqrt(3.0) * gain / math.sqrt(linear.in_features)
    init_shard_(weight, (linear.out_features, linear.in_features), linear_shard(linear),
                bound)


def init_shard_(param: Tensor, full_shape: tuple, shard: tuple, bound: float) -> None:
    """Draw the full tensor uniformly in [-bound, bound] and keep ``shard`` (slices)."""
    with torch.no_grad():
        if param.shape == full_shape:
            param.uniform_(-bound, bound)
        else:
            full = torch.empty(full_shape, device=param.device, dtype=param.dtype)
            param.copy_(full.uniform_(-bound, bound)[shard])


def linear_shard(linear: "BasicLinear") -> tuple:
    """``(rows, columns)`` of the full weight that this rank's shard holds."""
    tp, everything = linear.tp, slice(None)
    if not tp.active:
        return everything, everything
    if tp.mode == "column":
        return distributed.rank_slice(tp, linear.local_out), everything
    return everything, distributed.rank_slice(tp, linear.local_in)


def parallel_tokens(op, shape) -> tuple:
    """The leading dimensions of a linear layer's output: dim 0 gathered (column + SP)
    or scattered (row + SP) over the group."""
    tp, lead = op.tp, tuple(shape[:-1])
    if not (tp.active and tp.sequence_parallel):
        return lead
    if not lead:
        raise ValueError(f"{op.describe()} splits tokens along dim 0; got a 1-D input")
    if tp.mode == "column":
        return (lead[0] * tp.world_size, *lead[1:])
    if lead[0] % tp.world_size:
        raise ValueError(f"{op.describe()} reduce-scatters its output along dim 0: got "
                         f"{lead[0]} rows, which do not divide by the world size "
                         f"{tp.world_size}")
    return (lead[0] // tp.world_size, *lead[1:])


def fp8_forward_flags(ctx) -> tuple:
    """``(fp8_dtype, keep_input_t)`` of a BasicLinear's forward args."""
    recipe = ctx.recipe
    if recipe is None:
        return None, False
    return recipe.forward_dtype, ctx.needs.params[0]


def save_linear(ctx, args, aux: tuple) -> None:
    """BasicLinear's saved layout ``(input, weight)``: the input for wgrad, the weight for
    dgrad. Under FP8 the input is kept as its transposed FP8 copy only (all wgrad reads),
    from the forward result's aux (see :func:`linear_aux`); the weight is kept as the
    parameter itself and quantized again in the backward (see :func:`linear_saved`)."""
    x = aux[0] if args.fp8_dtype is None and aux else args.input
    if args.fp8_dtype is not None:
        if _fp8_input_kept_by_caller(args):
            x_q = as_fp8(args.input, args.fp8_dtype, args.keep_input_t)
            x_t, x_scale_inv = x_q._transpose, x_q._scale_inv
        else:
            x_t, x_scale_inv = aux[:2]
        x = transposed_only(x_t, x_scale_inv, args.input.dtype) if args.keep_input_t else None
    ctx.saved = (x if ctx.needs.params[0] else None, args.weight if ctx.needs.input else None)


def linear_aux(args, x_q) -> tuple:
    """The aux tensors a forward GEMM stage returns: in high precision the gathered input
    (column + sequence parallel) if any; under FP8 the input's transposed copy and scale,
    ``(x_t, x_scale_inv)`` (None where not kept). An input that arrived in FP8 is the
    caller's to save (see :func:`handed_in_fp8`)."""
    if args.fp8_dtype is None:
        return () if x_q is None else (x_q,)
    if _fp8_input_kept_by_caller(args):
        return ()
    return (x_q._transpose, x_q._scale_inv)


def _fp8_input_kept_by_caller(args) -> bool:
    """The input arrived in FP8 and the GEMM used it as it is (not gathered): its buffers
    are the caller's, so the stage returns none of them (see :func:`handed_in_fp8`)."""
    return handed_in_fp8(args.input, args.fp8_dtype) and not args.tp.gathers_input


def linear_saved(ctx) -> tuple:
    """``(input, weight, grad_fp8_dtype)`` for a BasicLinear's backward GEMMs.

    Under FP8 the weight is quantized again, with its transposed copy for dgrad: the
    same bits as in the forward (current scaling of an unchanged parameter; autograd
    checks its version), and no FP8 copy of every weight held between the passes.
    """
    x, weight = ctx.saved
    if ctx.recipe is None:
        return x, weight, None
    if weight is not None:
        w_q = quantize_raw(weight, ctx.recipe.forward_dtype, columnwise=True)
        weight = transposed_only(w_q._transpose, w_q._scale_inv, weight.dtype)
    return x, weight, ctx.recipe.backward_dtype


def linear_backward_args(ctx, grad_output, tp: TensorParallel) -> LinearBackwardArgs:
    x, weight, grad_dtype = linear_saved(ctx)
    return LinearBackwardArgs(grad_output, x, weight, grad_dtype, ctx.needs.input,
                              ctx.needs.params[0], tp)


def linear_backward(args, accumulate_into=None) -> tuple:
    """(dgrad or None, (wgrad or None,)) for LinearBackwardArgs-like args."""
    dx, dw = gemm_backward(args.grad_output, args.input, args.weight, args.grad_fp8_dtype,
                           args.need_grad_input, args.need_grad_weight, accumulate_into, args.tp)
    return dx, (dw,)
