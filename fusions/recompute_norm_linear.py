"""RecomputeNormLinear: a joint fusion that recomputes a norm's output in the backward
instead of saving it for the linear layer after it."""

from typing import Optional

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import (GemmBackwardArgs, GemmForwardArgs, bias_grad,
                                       gemm_backward, gemm_forward)
from fusible.functional.norms import (effective_gamma, layer_norm_backward, layer_norm_forward,
                                      rms_norm_backward, rms_norm_forward)
from fusible.functional.parallel import NOT_PARALLEL
from fusible.ops import BackwardResult, BasicLinear, Bias, ForwardResult, LayerNorm, RMSNorm

Tensor = torch.Tensor


@attrs.define
class NormLinearForwardArgs:
    input: Tensor
    norm_weight: Tensor
    norm_bias: Optional[Tensor]  # LayerNorm's; None for RMSNorm
    linear_weight: Tensor
    bias: Optional[Tensor]       # the Bias op's, when the pattern has one
    normalized_shape: list[int]
    eps: float
    zero_centered_gamma: bool


@attrs.define
class NormLinearSaved:
    """The norm's input and statistics (for its own backward and to recompute its output
    for the weight gradient) and the linear weight (for the dgrad); None where not needed.
    The norm's output, which the basic ops would save, is not kept."""

    input: Optional[Tensor]
    mean: Optional[Tensor]       # LayerNorm's
    rstd: Optional[Tensor]
    norm_weight: Optional[Tensor]
    norm_bias: Optional[Tensor]
    linear_weight: Optional[Tensor]


@attrs.define
class NormLinearBackwardArgs:
    grad_output: Tensor
    saved: NormLinearSaved
    normalized_shape: list[int]
    eps: float
    zero_centered_gamma: bool
    layer_norm: bool
    norm_needs: list[bool]       # input, weight (, bias): the norm's gradients
    linear_needs: list[bool]     # dgrad, wgrad (, the Bias op's gradient: when it has one)
    wgrad_dtype: Optional[torch.dtype]


def _norm(x, saved_or_args, layer_norm: bool, normalized_shape, eps, zero_centered) -> tuple:
    """``(y, mean or None, rstd)``: the norm's forward, the same kernels as its op's."""
    gamma = effective_gamma(saved_or_args.norm_weight, zero_centered)
    if layer_norm:
        return layer_norm_forward(x, gamma, saved_or_args.norm_bias, normalized_shape, eps)
    y, rstd = rms_norm_forward(x, gamma, normalized_shape, eps)
    return y, None, rstd


class RecomputeNormLinear(FusedOperation):
    """A joint fusion: a norm with ``recompute_output=True``, then a linear layer (and its
    bias), owning both passes. The forward runs the norm and the GEMM as their ops do but
    saves the norm's input and statistics only; the backward recomputes the norm's output
    for the weight gradient (the same kernel, so the same bits) and then runs the norm's
    backward. One activation of the input's size less between the passes, for one more
    norm pass in the backward (Megatron's selective recompute of the norm; what
    torch.compile's partitioner does by default).

    Pattern: ``RMSNorm | LayerNorm (recompute_output=True), BasicLinear, Bias?``.
    Refused under an FP8 recipe (the linear layer keeps the norm's output as a transposed
    FP8 copy, which a recomputation would have to reproduce with the forward's scale), for
    tensor-parallel layers, and where the weight needs no gradient (nothing of the norm's
    output would be saved). The backward's gradients are those of the basic ops, bit for
    bit.
    """

    direction = "both"
    pattern = Pattern(Op((RMSNorm, LayerNorm), name="norm", recompute_output=True),
                      Op(BasicLinear, name="linear"), Op(Bias, name="bias", optional=True))
    fwd_args_type = NormLinearForwardArgs
    bwd_args_type = NormLinearBackwardArgs
    saved_type = NormLinearSaved

    @classmethod
    def accepts(cls, match, env):
        linear = match["linear"]
        if env.recipe is not None:
            return ("under an FP8 recipe the linear layer saves the norm's output as its "
                    "transposed FP8 copy; recomputing it would need the forward's scale")
        if linear.tp.active:
            return f"{linear.describe()} is tensor-parallel"
        if not env.needs[match.indices[1]].params[0]:
            return (f"{linear.describe()}'s weight needs no gradient: the norm's output "
                    f"would not be saved")
        return True

    def input_format(self, recipe, needs):
        return None  # never planned under a recipe (accepts)

    def grad_format(self, recipe, needs):
        return None

    def forward_args(self, input, params, extra_inputs, ctxs):
        norm = self.match["norm"]
        k = len(norm.param_names)
        norm_bias = params[1] if k == 2 else None
        bias = params[k + 1] if len(params) > k + 1 else None
        return NormLinearForwardArgs(input, params[0], norm_bias, params[k], bias,
                                     list(norm.normalized_shape), norm.eps,
                                     norm.zero_centered_gamma)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        y, mean, rstd = _norm(args.input, args, args.norm_bias is not None,
                              args.normalized_shape, args.eps, args.zero_centered_gamma)
        out, _ = gemm_forward(GemmForwardArgs(y, args.linear_weight, None, None, NOT_PARALLEL),
                              args.bias)
        return ForwardResult(out, (), (rstd,) if mean is None else (mean, rstd))

    def save_for_backward(self, args, result, ctxs):
        norm_needs, linear_needs = ctxs[0].needs, ctxs[1].needs
        keep_norm = norm_needs.any or linear_needs.params[0]
        if not (keep_norm or linear_needs.input):
            return
        mean, rstd = (None, *result.aux) if len(result.aux) == 1 else result.aux
        ctxs[0].saved = NormLinearSaved(
            *((args.input, mean, rstd, args.norm_weight, args.norm_bias) if keep_norm
              else (None,) * 5),
            args.linear_weight if linear_needs.input else None)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        norm, linear = self.match["norm"], self.match["linear"]
        norm_needs = [ctxs[0].needs.input, *ctxs[0].needs.params]
        linear_needs = [ctxs[1].needs.input, ctxs[1].needs.params[0],
                        *(c.needs.params[0] for c in ctxs[2:])]
        return NormLinearBackwardArgs(grad_output, ctxs[0].saved, list(norm.normalized_shape),
                                      norm.eps, norm.zero_centered_gamma,
                                      isinstance(norm, LayerNorm), norm_needs, linear_needs,
                                      linear.wgrad_dtype)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        saved, dy = args.saved, args.grad_output
        dgrad, wgrad, *bias_needs = args.linear_needs
        y = None
        if wgrad:  # the norm's output again, bit for bit
            y = _norm(saved.input, saved, args.layer_norm, args.normalized_shape, args.eps,
                      args.zero_centered_gamma)[0]
        d_norm, dw = gemm_backward(GemmBackwardArgs(dy, y, saved.linear_weight, None, dgrad,
                                                    wgrad, NOT_PARALLEL,
                                                    wgrad_dtype=args.wgrad_dtype))
        del y
        linear_grads = (dw, *(bias_grad(dy) if need else None for need in bias_needs))
        norm_grads = cls._norm_backward(args, d_norm)
        return BackwardResult(norm_grads[0], (*norm_grads[1:], *linear_grads))

    @staticmethod
    def _norm_backward(args, d_norm) -> tuple:
        """``(dx, dweight[, dbias])`` of the norm (None where not needed)."""
        saved, needs = args.saved, args.norm_needs
        if d_norm is None:  # the norm needs nothing
            return (None,) * len(needs)
        gamma = effective_gamma(saved.norm_weight, args.zero_centered_gamma)
        if args.layer_norm:
            dx, dw, db = layer_norm_backward(d_norm, saved.input, saved.mean, saved.rstd, gamma,
                                             saved.norm_bias, args.normalized_shape, needs)
            return dx, None if dw is None else dw.to(saved.norm_weight.dtype), db
        dx, dw = rms_norm_backward(d_norm, saved.input, saved.rstd, gamma,
                                   args.normalized_shape, *needs)
        return dx, None if dw is None else dw.to(saved.norm_weight.dtype)

    @classmethod
    def example(cls):
        # FP8: refused (accepts), so no FP8 case
        return Example((RMSNorm(32, recompute_output=True), BasicLinear(32, 48)), (3, 5, 32),
                       fp8=False)
