"""GroupedLinear: one linear layer per group (a mixture of experts' experts), each applied
to its own consecutive run of tokens."""

from __future__ import annotations

import math
from typing import Optional

import attrs
import torch
from torch import nn

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional.grouped import (bias_per_token, check_splits, grouped_bias_grad,
                                        grouped_dgrad, grouped_forward, grouped_wgrad)
from fusible.functional.linear import like_tokens, tokens_2d
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class GroupedForwardArgs:
    input: Tensor
    splits: Tensor
    weight: Tensor
    bias: Optional[Tensor]


@attrs.define
class GroupedSaved:
    """GroupedLinear's saved record: the input for wgrad, the weight for dgrad (None where
    not needed), the split sizes."""

    input: Optional[Tensor]
    weight: Optional[Tensor]
    splits: Tensor


@attrs.define
class GroupedBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    weight: Optional[Tensor]
    splits: Tensor
    need_grad_input: bool
    need_grad_weight: bool
    need_grad_bias: bool
    num_groups: int
    has_bias: bool


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
    8), one GEMM per group elsewhere (which reads the sizes on the host).

    Parameters
    ----------
    num_groups, in_features, out_features : int
    bias : bool
        One bias row per group.
    device, dtype
        Where and in which dtype to create the parameters.

    Attributes
    ----------
    weight : Parameter
        (num_groups, out_features, in_features): group ``g``'s is ``nn.Linear``'s weight
        of expert ``g`` (:meth:`from_linears`, :meth:`to_linears` convert).
    bias : Parameter or None
        (num_groups, out_features).
    """

    param_names = ("weight", "bias")
    num_extra_inputs = 1
    attribute_checks = {"num_groups": checks.positive_int("num_groups"),
                        "in_features": checks.positive_int("in_features"),
                        "out_features": checks.positive_int("out_features")}
    fwd_args_type = GroupedForwardArgs
    bwd_args_type = GroupedBackwardArgs
    saved_type = GroupedSaved

    def __init__(self, num_groups: int, in_features: int, out_features: int, *,
                 bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.num_groups, self.in_features, self.out_features = (num_groups, in_features,
                                                                out_features)
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features,
                                               device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(num_groups, out_features, device=device,
                                              dtype=dtype)) if bias else None)
        if not bias:  # the fuser computes with the parameters it names
            self.param_names = ("weight",)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each group like ``torch.nn.Linear(in_features, out_features)``."""
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight.view(-1, self.in_features), a=math.sqrt(5))
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def describe(self) -> str:
        bias = ", bias=True" if getattr(self, "bias", None) is not None else ""
        return (f"GroupedLinear(num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}{bias})")

    def validate(self, shape, dtype, device, extra_inputs=()):
        (splits,) = extra_inputs
        if not (isinstance(splits, torch.Tensor) and splits.dim() == 1
                and len(splits) == self.num_groups
                and splits.dtype in (torch.int32, torch.int64)):
            got = (f"{splits.dtype} of shape {tuple(splits.shape)}"
                   if isinstance(splits, torch.Tensor) else type(splits).__name__)
            raise TypeError(f"{self.describe()} takes the split sizes as an integer tensor "
                            f"(int32 or int64) of shape ({self.num_groups},), got {got}")
        if splits.device != device:
            raise ValueError(f"{self.describe()}: the split sizes are on {splits.device}, "
                             f"the input on {device}")
        if not shape or shape[-1] != self.in_features:
            raise ValueError(f"{self.describe()} got input of shape {tuple(shape)}; its last "
                             f"dimension must be {self.in_features}")
        for name in self.param_names:
            self._check_param(name, self.param(name), dtype, device,
                              tuple(getattr(self, name).shape))
        return (*shape[:-1], self.out_features)

    def validate_fp8(self, shape) -> None:
        """No FP8 grouped GEMMs yet: an error rather than bf16 GEMMs where FP8 was asked."""
        raise NotImplementedError(f"{self.describe()} has no FP8 grouped GEMMs yet: run the "
                                  f"experts inside fusible.autocast(enabled=False)")

    def forward_args(self, input, params, extra_inputs, ctxs):
        return GroupedForwardArgs(input, extra_inputs[0], params[0],
                                  params[1] if len(params) > 1 else None)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x2 = tokens_2d(args.input)
        check_splits(args.splits, x2.shape[0], "GroupedLinear")
        y = grouped_forward(x2, args.weight, args.splits)
        if args.bias is not None:
            y = y + bias_per_token(args.bias, args.splits, x2.shape[0])
        return ForwardResult(like_tokens(y, args.input))

    @classmethod
    def forward_fake(cls, args, *, in_custom_op=False):
        """The output's shape and dtype without reading the sizes (compiled graphs)."""
        shape = (*args.input.shape[:-1], args.weight.shape[-2])
        return ForwardResult(args.input.new_empty(shape))

    def save_for_backward(self, args, result, ctxs):
        needs = ctxs[0].needs
        if needs.any:
            ctxs[0].saved = GroupedSaved(args.input if needs.params[0] else None,
                                         args.weight if needs.input else None, args.splits)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        needs, saved = ctxs[0].needs, ctxs[0].saved
        return GroupedBackwardArgs(grad_output, saved.input, saved.weight, saved.splits,
                                   needs.input, needs.params[0],
                                   len(needs.params) > 1 and needs.params[1], self.num_groups,
                                   len(needs.params) > 1)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dy = tokens_2d(args.grad_output)
        dx = dw = db = None
        if args.need_grad_input:
            dx = like_tokens(grouped_dgrad(dy, args.weight, args.splits), args.grad_output)
        if args.need_grad_weight:
            dw = grouped_wgrad(dy, tokens_2d(args.input), args.splits, args.num_groups)
        if args.need_grad_bias:
            db = grouped_bias_grad(dy, args.splits)
        return BackwardResult(dx, (dw, db) if args.has_bias else (dw,), (None,))

    @classmethod
    def backward_fake(cls, args, *, in_custom_op=False):
        """The gradients' shapes and dtypes without reading the sizes (compiled graphs)."""
        dy = args.grad_output
        g, n = args.num_groups, dy.shape[-1]
        dx = dy.new_empty((*dy.shape[:-1], args.weight.shape[-1])) if args.need_grad_input \
            else None
        dw = dy.new_empty((g, n, args.input.shape[-1])) if args.need_grad_weight else None
        db = dy.new_empty((g, n)) if args.need_grad_bias else None
        return BackwardResult(dx, (dw, db) if args.has_bias else (dw,), (None,))

    def reference(self, x, extra_inputs, params):
        sizes = extra_inputs[0].tolist()
        x2 = x.reshape(-1, x.shape[-1])
        rows, start = [], 0
        for g, size in enumerate(sizes):
            y = x2[start:start + size] @ params[0][g].t()
            rows.append(y + params[1][g] if len(params) > 1 else y)
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
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")
