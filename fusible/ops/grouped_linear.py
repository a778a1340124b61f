"""GroupedLinear: one linear layer per group (a mixture of experts' experts), each applied
to its own consecutive run of tokens."""

from __future__ import annotations

import math
from typing import Optional, cast

import attrs
import torch
from torch import nn

from fusible.core.arg_types import DTypeArg, DeviceArg
from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.grouped import (add_scaled_bias, bias_per_token, check_splits,
                                        grouped_bias_grad, grouped_dgrad, grouped_forward,
                                        grouped_wgrad, scaled_bias_grads)
from fusible.functional.grouped_fp8 import (cast_grouped_weight, check_aligned_splits,
                                            fp8_grouped_mm, fp8_grouped_wgrad)
from fusible.functional.linear import as_fp8, handed_in, like_tokens, tokens_2d
from fusible.module import BasicOperation
from fusible.quantization.format import Float8Format
from fusible.quantization.tensor.float8_tensor import Float8Tensor, Fp8Able
from fusible.quantization.tensor.quantize import transposed_only

Tensor = torch.Tensor


_INTEGER = (torch.int32, torch.int64)


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


# Every grouped FP8 operand is E4M3 (see fusible.functional.grouped_fp8).
_E4M3 = torch.float8_e4m3fn


@attrs.define
class GroupedForwardArgs:
    """``input_format``: under FP8 the input's (tensorwise E4M3, with the transposed copy
    where wgrad needs it); None in high precision. ``keep_weight_transpose``: under FP8
    with dgrad to come, the weight's transposed FP8 copy is written by the forward's cast
    (one read of the weight, not two) and kept for it. ``scales``: each token's bias
    scale (``scale_bias=True``), else None."""

    input: Fp8Able
    splits: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    input_format: Optional[Float8Format] = None
    keep_weight_transpose: bool = False
    scales: Optional[Tensor] = None


@attrs.define
class GroupedSaved:
    """GroupedLinear's saved record: the input for wgrad (under FP8 its transposed copy
    only), the weight for dgrad (None where not needed; under FP8 its transposed FP8 copy
    and per-group scales instead, from the forward's cast), the split sizes; with
    ``scale_bias`` the bias and the tokens' bias scales (each gradient reads the other)."""

    input: Optional[Fp8Able]
    weight: Optional[Tensor]
    splits: Tensor
    weight_transpose: Optional[Tensor] = None
    weight_scale_inv: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    scales: Optional[Tensor] = None


@attrs.define
class GroupedBackwardArgs:
    grad_output: Fp8Able
    input: Optional[Fp8Able]
    weight: Optional[Tensor]
    splits: Tensor
    need_grad_input: bool
    need_grad_weight: bool
    need_grad_bias: bool
    num_groups: int
    has_bias: bool
    grad_format: Optional[Float8Format] = None
    weight_transpose: Optional[Tensor] = None
    weight_scale_inv: Optional[Tensor] = None
    scale_bias: bool = False
    need_grad_scales: bool = False
    bias: Optional[Tensor] = None
    scales: Optional[Tensor] = None


class GroupedLinear(BasicOperation):
    """``y[tokens of group g] = x[those tokens] @ weight[g].T (+ bias[g])``: the experts
    of a mixture-of-experts layer as one op.

    ``model(x, splits)``: the tokens are sorted by group (``x`` is (tokens, in_features),
    or (..., in_features) flattened to tokens), and ``splits`` (an integer tensor of
    ``num_groups`` sizes, on ``x``'s device) says how many tokens each group has, empty
    groups included. The sizes are a tensor so that a compiled model does not recompile
    when the routing changes; they are checked (non-negative, adding up to the tokens)
    on the device, without a host synchronisation. Forward, dgrad and wgrad are grouped
    GEMMs: ``torch._grouped_mm`` on Hopper GPUs in bf16 (feature sizes multiple of
    8), Triton grouped GEMMs on other GPUs and dtypes (the sizes read on the device too),
    one GEMM per group on the CPU (which reads the sizes on the host).

    Under an FP8 recipe (``fusible.autocast``) the GEMMs are FP8 grouped GEMMs
    (``torch._scaled_grouped_mm`` on Hopper, Triton's on other GPUs of compute capability
    8.9 or more, one ``torch._scaled_mm`` per group on the CPU): the input and the output
    gradient scaled per tensor (handed over quantized by the stage before, like a linear
    layer's), each group's weight by its own scale, everything E4M3 (Hopper's grouped FP8
    GEMM takes no E5M2; see :mod:`fusible.functional.grouped_fp8`). The feature sizes must
    be multiples of 16 and, for the weight gradient, every group's token count too
    (``fusible.moe.permute_tokens(..., align=16)`` pads them; checked on the device).

    Parameters
    ----------
    num_groups, in_features, out_features : int
    bias : bool
        One bias row per group.
    scale_bias : bool
        Scale each token's bias row by a number of its own (a mixture of experts' routing
        probability, as TransformerEngine's ``GroupedLinear(scale_bias=True)``):
        ``y[i] = x[i] @ weight[g].T + scales[i] * bias[g]``, called ``model(x, splits,
        scales)`` with ``scales`` of shape ``x.shape[:-1]`` (any floating dtype, on
        ``x``'s device; it may require grad: ``dscales[i] = dy[i] . bias[g]``). Computed
        in float32 for 16-bit tensors, rounded once. Needs ``bias=True``.
    device, dtype
        Where and in which dtype to create the parameters.
    fp8 : bool, optional
        Under an FP8 recipe: True runs the grouped GEMMs in FP8, False in high precision;
        None (default) leaves it to the recipe's ``gemm_policy`` (by the experts' weight
        shape, at the grouped FP8 GEMMs' rate: :mod:`fusible.quantization.gemm_policy`).

    Attributes
    ----------
    weight : Parameter
        (num_groups, out_features, in_features): group ``g``'s is ``nn.Linear``'s weight
        of expert ``g`` (:meth:`from_linears`, :meth:`to_linears` convert).
    bias : Parameter or None
        (num_groups, out_features).
    """

    param_names: tuple = ("weight", "bias")  # an instance without a bias: ("weight",)
    num_extra_inputs = 1
    attribute_checks = {"num_groups": checks.positive_int("num_groups"),
                        "in_features": checks.positive_int("in_features"),
                        "out_features": checks.positive_int("out_features"),
                        "fp8": checks.optional(checks.boolean("fp8"))}
    fwd_args_type = GroupedForwardArgs
    bwd_args_type = GroupedBackwardArgs
    saved_type = GroupedSaved

    def __init__(self, num_groups: int, in_features: int, out_features: int, *,
                 bias: bool = False, scale_bias: bool = False, device: DeviceArg = None,
                 dtype: DTypeArg = None, fp8: Optional[bool] = None):
        super().__init__()
        self.fp8 = fp8
        if scale_bias and not bias:
            raise ValueError(f"GroupedLinear(num_groups={num_groups}, in_features="
                             f"{in_features}, out_features={out_features}): scale_bias=True "
                             f"scales the bias, and there is none (bias=False)")
        self.scale_bias = bool(scale_bias)
        self.num_extra_inputs = 2 if scale_bias else 1  # the split sizes (and the scales)
        self.num_groups, self.in_features, self.out_features = (num_groups, in_features,
                                                                out_features)
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features,
                                               device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(num_groups, out_features, device=device,
                                              dtype=dtype)) if bias else None)
        if not bias:  # the fuser computes with the parameters it names
            self.param_names = ("weight",)
        self.reset_parameters()

    fp8_gemm_grouped = True  # the FP8 policy's grouped rate decides

    def fp8_gemm_shape(self) -> tuple:
        """``(in_features, out_features)`` of each group's GEMM, for the FP8 policy."""
        return self.in_features, self.out_features

    def reset_parameters(self) -> None:
        """Each group like ``torch.nn.Linear(in_features, out_features)``."""
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight.view(-1, self.in_features), a=math.sqrt(5))
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def describe(self) -> str:
        bias = ", bias=True" if getattr(self, "bias", None) is not None else ""
        bias += ", scale_bias=True" if getattr(self, "scale_bias", False) else ""
        return (f"GroupedLinear(num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}{bias})")

    def validate(self, shape, dtype, device, extra_inputs=()):
        splits = extra_inputs[0]
        checks.extra_tensor(self.describe(), splits, "the split sizes",
                            "an integer tensor (int32 or int64)", (self.num_groups,),
                            _INTEGER.__contains__, device)
        if not shape or shape[-1] != self.in_features:
            raise ValueError(f"{self.describe()} got input of shape {tuple(shape)}; its last "
                             f"dimension must be {self.in_features}")
        if self.scale_bias:
            checks.extra_tensor(self.describe(), extra_inputs[1], "the bias scales",
                                "a floating tensor (one scale per token)", shape[:-1],
                                _floating, device)
        for name in self.param_names:
            self._check_param(name, self.param(name), dtype, device,
                              tuple(getattr(self, name).shape))
        return (*shape[:-1], self.out_features)

    def validate_fp8(self, shape, recipe) -> None:
        """FP8 GEMMs need the feature sizes divisible by 16 (the token counts are checked
        on the device, see the class notes)."""
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(f"{self.describe()} under an FP8 recipe needs in_features and "
                             f"out_features divisible by 16; run it outside fusible.autocast")

    def quantizes(self, recipe, direction):
        return recipe is not None

    def input_format(self, recipe, needs):
        return _tokens_format(recipe, needs[0])

    def grad_format(self, recipe, needs):
        # With a bias, dy arrives in high precision: the bias gradient sums it unrounded.
        return None if self.bias is not None else _tokens_format(recipe, needs[0])

    def forward_args(self, input, params, extra_inputs, ctxs):
        fmt = _tokens_format(ctxs[0].recipe, ctxs[0].needs)
        return GroupedForwardArgs(input, extra_inputs[0], params[0],
                                  params[1] if len(params) > 1 else None, fmt,
                                  fmt is not None and ctxs[0].needs.input,
                                  extra_inputs[1] if self.scale_bias else None)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x2 = tokens_2d(args.input)
        check_splits(args.splits, x2.shape[0], "GroupedLinear")
        aux = ()
        if args.input_format is None:
            y = grouped_forward(x2, args.weight, args.splits)
        else:
            y, aux = _fp8_forward(args)
        if args.scales is not None:
            y = add_scaled_bias(y, args.bias, args.scales, args.splits)
        elif args.bias is not None:
            y = y + bias_per_token(args.bias, args.splits, x2.shape[0])
        return ForwardResult(like_tokens(y, args.input), (), aux)

    @classmethod
    def forward_fake(cls, args, *, in_custom_op=False):
        """The results' shapes and dtypes without reading the sizes (compiled graphs)."""
        x = args.input
        y = torch.empty((*x.shape[:-1], args.weight.shape[-2]), dtype=x.dtype, device=x.device)
        fmt = args.input_format
        if fmt is None:
            return ForwardResult(y)
        aux = ()
        if not handed_in(x, fmt) and fmt.columnwise:
            tokens = x.numel() // x.shape[-1]
            aux = (torch.empty((x.shape[-1], tokens), dtype=_E4M3, device=x.device),
                   torch.empty((), dtype=torch.float32, device=x.device))
        if args.keep_weight_transpose:
            g, n, k = args.weight.shape
            aux += (torch.empty((g, k, n), dtype=_E4M3, device=x.device),
                    torch.empty((g,), dtype=torch.float32, device=x.device))
        return ForwardResult(y, (), aux)

    def save_for_backward(self, args, result, ctxs):
        needs = ctxs[0].needs
        if not needs.any:
            return
        x = args.input if needs.params[0] else None
        if args.input_format is None:
            saved = GroupedSaved(x, args.weight if needs.input else None, args.splits)
        else:
            input_aux, weight_aux = _split_aux(args, result.aux)
            if needs.params[0]:
                x = _saved_fp8_input(args, input_aux)
            saved = GroupedSaved(x, None, args.splits, *weight_aux)
        if args.scales is not None:
            saved.bias, saved.scales = args.bias, args.scales
        ctxs[0].saved = saved

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        needs, saved, recipe = ctxs[0].needs, ctxs[0].saved, ctxs[0].recipe
        fmt = _tokens_format(recipe, needs)
        return GroupedBackwardArgs(grad_output, saved.input, saved.weight, saved.splits,
                                   needs.input, needs.params[0],
                                   len(needs.params) > 1 and needs.params[1], self.num_groups,
                                   len(needs.params) > 1, fmt, saved.weight_transpose,
                                   saved.weight_scale_inv, self.scale_bias,
                                   self.scale_bias and needs.extra_inputs[1], saved.bias,
                                   saved.scales)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if args.grad_format is not None:
            dx, dw = _fp8_backward(args)
        else:
            dy = tokens_2d(args.grad_output)
            dx = dw = None
            if args.need_grad_input:
                dx = like_tokens(grouped_dgrad(dy, args.weight, args.splits), args.grad_output)
            if args.need_grad_weight:
                dw = grouped_wgrad(dy, tokens_2d(args.input), args.splits, args.num_groups)
        dy2, ds = tokens_2d(args.grad_output), None
        if args.scale_bias:
            db, ds = scaled_bias_grads(dy2, args.bias, args.scales, args.splits,
                                       args.need_grad_bias, args.need_grad_scales)
        else:
            db = grouped_bias_grad(dy2, args.splits) if args.need_grad_bias else None
        return BackwardResult(dx, (dw, db) if args.has_bias else (dw,),
                              (None, ds) if args.scale_bias else (None,))

    @classmethod
    def backward_fake(cls, args, *, in_custom_op=False):
        """The gradients' shapes and dtypes without reading the sizes (compiled graphs)."""
        dy = args.grad_output
        g, n = args.num_groups, dy.shape[-1]

        def empty(*shape):
            return torch.empty(shape, dtype=dy.dtype, device=dy.device)
        if args.need_grad_input:
            k = (args.weight.shape[-1] if args.weight is not None
                 else args.weight_transpose.shape[1])
            dx = empty(*dy.shape[:-1], k)
        else:
            dx = None
        k = args.input.shape[-1] if args.need_grad_weight else 0
        dw = empty(g, n, k) if args.need_grad_weight else None
        db = empty(g, n) if args.need_grad_bias else None
        ds = torch.empty_like(args.scales) if args.need_grad_scales else None
        return BackwardResult(dx, (dw, db) if args.has_bias else (dw,),
                              (None, ds) if args.scale_bias else (None,))

    def reference(self, x, extra_inputs, params):
        sizes = extra_inputs[0].tolist()
        x2 = x.reshape(-1, x.shape[-1])
        scales = extra_inputs[1].reshape(-1, 1).to(x.dtype) if self.scale_bias else None
        rows, start = [], 0
        for g, size in enumerate(sizes):
            y = x2[start:start + size] @ params[0][g].t()
            if scales is not None:
                y = y + scales[start:start + size] * params[1][g]
            elif len(params) > 1:
                y = y + params[1][g]
            rows.append(y)
            start += size
        return torch.cat(rows).reshape(*x.shape[:-1], self.out_features), ()

    @classmethod
    def example(cls):
        return Example((cls(3, 16, 32, bias=True),), (8, 16),
                       extra_input_values=(torch.tensor([3, 0, 5]),), fp8=False)

    @classmethod
    def from_linears(cls, linears) -> "GroupedLinear":
        """A GroupedLinear holding these ``nn.Linear`` experts (same sizes, all with a bias
        or none), on their device and in their dtype."""
        first = linears[0]
        if any(lin.weight.shape != first.weight.shape or (lin.bias is None)
               != (first.bias is None) for lin in linears):
            raise ValueError("GroupedLinear.from_linears: the experts must have one shape and "
                             "all a bias or none")
        op = cls(len(linears), first.in_features, first.out_features,
                 bias=first.bias is not None, device=first.weight.device,
                 dtype=first.weight.dtype)
        with torch.no_grad():
            op.weight.copy_(torch.stack([lin.weight for lin in linears]))
            if op.bias is not None:
                op.bias.copy_(torch.stack([lin.bias for lin in linears]))
        return op

    def to_linears(self) -> nn.ModuleList:
        """The experts as ``nn.Linear`` modules (copies of the parameters)."""
        out = nn.ModuleList()
        for g in range(self.num_groups):
            lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                            device=self.weight.device, dtype=self.weight.dtype)
            with torch.no_grad():
                lin.weight.copy_(self.weight[g])
                if self.bias is not None:
                    lin.bias.copy_(self.bias[g])
            out.append(lin)
        return out

    def extra_repr(self) -> str:
        scaled = ", scale_bias=True" if self.scale_bias else ""
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}{scaled}")


def _tokens_format(recipe, needs) -> Optional[Float8Format]:
    """The tokens' FP8 format (input, output gradient) under ``recipe`` (None: none): E4M3
    per tensor whatever the recipe, with the transposed copy where wgrad follows."""
    return None if recipe is None else Float8Format(_E4M3, needs.params[0])


def _fp8_forward(args: GroupedForwardArgs) -> tuple:
    """``(y, aux)`` of the FP8 forward: aux as :func:`_split_aux` splits it."""
    fmt, x = args.input_format, args.input
    assert fmt is not None  # the FP8 forward
    mine = not handed_in(x, fmt)  # an input handed over quantized is the caller's to save
    x_q = as_fp8(x, fmt if mine else fmt.rowwise())
    w_data, w_t, w_scale_inv = cast_grouped_weight(args.weight, _E4M3,
                                                   columnwise=args.keep_weight_transpose)
    y = fp8_grouped_mm(x_q._data, x_q._scale_inv, w_data, w_scale_inv, args.splits,
                       x_q.dtype, fast_accum=True)
    aux = (x_q._transpose, x_q._scale_inv) if mine and fmt.columnwise else ()
    return y, aux + ((w_t, w_scale_inv) if args.keep_weight_transpose else ())


def _split_aux(args: GroupedForwardArgs, aux: tuple) -> tuple:
    """``(input part, weight part)`` of the FP8 forward's aux: the input's transposed copy
    and scale (where the forward made them), the weight's (where dgrad is to come)."""
    if args.keep_weight_transpose:
        return aux[:-2], aux[-2:]
    return aux, ()


def _saved_fp8_input(args: GroupedForwardArgs, aux: tuple) -> Float8Tensor:
    """The input as wgrad reads it: its transposed FP8 copy alone."""
    if not aux:  # handed over quantized: its transposed copy made here if missing
        assert args.input_format is not None  # the FP8 forward's, columnwise (wgrad follows)
        x_q = as_fp8(args.input, args.input_format)
        assert x_q._transpose is not None
        return transposed_only(x_q._transpose, x_q._scale_inv, x_q.dtype)
    return transposed_only(aux[0], aux[1], args.input.dtype)


def _fp8_backward(args: GroupedBackwardArgs) -> tuple:
    """``(dx, dw)`` from FP8 grouped GEMMs (None where not needed)."""
    dy = args.grad_output
    assert args.grad_format is not None  # the FP8 backward
    dy_q = as_fp8(dy, args.grad_format)
    dx = dw = None
    if args.need_grad_input:
        # kept from the forward's cast for dgrad (keep_weight_transpose)
        assert args.weight_transpose is not None and args.weight_scale_inv is not None
        dx = fp8_grouped_mm(dy_q._data, dy_q._scale_inv, args.weight_transpose,
                            args.weight_scale_inv, args.splits, dy_q.dtype, fast_accum=False)
        dx = dx.view(*dy.shape[:-1], dx.shape[-1])
    if args.need_grad_weight:
        check_aligned_splits(args.splits, "GroupedLinear")
        x_q = cast(Float8Tensor, args.input)  # saved as its transposed copy (_saved_fp8_input)
        assert dy_q._transpose is not None and x_q._transpose is not None  # columnwise formats
        dw = fp8_grouped_wgrad(dy_q._transpose, dy_q._scale_inv, x_q._transpose,
                               x_q._scale_inv, args.splits, args.num_groups, dy_q.dtype)
    return dx, dw
