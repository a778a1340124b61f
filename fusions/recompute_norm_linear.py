"""RecomputeNormLinear: a joint fusion that recomputes a norm's output in the backward
instead of saving it for the linear layer after it."""

from typing import Optional

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.linear import bias_grad, gemm_backward, gemm_forward
from fusible.functional.linear_records import GemmBackwardArgs, GemmForwardArgs
from fusible.functional.linear_state import gemm_grad_format, gemm_input_format
from fusible.functional.norms import (effective_gamma, layer_norm_backward, norm_forward,
                                      norm_forward_fp8_keeping_amax, norm_output_fp8_again,
                                      rms_norm_backward)
from fusible.functional.parallel import TensorParallel
from fusible.ops import BackwardResult, BasicLinear, Bias, ForwardResult, LayerNorm, RMSNorm
from fusible.quantization.format import Float8Format, bound_format

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
    input_format: Optional[Float8Format]   # under FP8: the norm output's, as the GEMM reads it
    weight_format: Optional[Float8Format]
    parallel: TensorParallel               # the linear layer's: column-parallel or none


@attrs.define
class NormLinearSaved:
    """The norm's input and statistics (for its own backward and to recompute its output
    for the weight gradient), the linear weight (for the dgrad) and, under FP8, the amaxes
    that give the forward's scales again; None where not needed. The norm's output, which
    the basic ops would save, is not kept."""

    input: Optional[Tensor]
    mean: Optional[Tensor]       # LayerNorm's
    rstd: Optional[Tensor]
    norm_weight: Optional[Tensor]
    norm_bias: Optional[Tensor]
    linear_weight: Optional[Tensor]
    output_amax: Optional[Tensor] = None  # FP8: the norm output's
    weight_amax: Optional[Tensor] = None  # FP8: the linear weight's


@attrs.define
class NormLinearBackwardArgs:
    grad_output: Tensor
    saved: NormLinearSaved
    normalized_shape: list[int]
    eps: float
    zero_centered_gamma: bool
    norm_needs: list[bool]       # input, weight (, bias): the norm's gradients
    linear_needs: list[bool]     # dgrad, wgrad (, the Bias op's gradient: when it has one)
    wgrad_dtype: Optional[torch.dtype]
    input_format: Optional[Float8Format]  # FP8: the forward's, to quantize the recomputation
    grad_format: Optional[Float8Format]
    weight_format: Optional[Float8Format]
    parallel: TensorParallel


class RecomputeNormLinear(FusedOperation):
    """A joint fusion: a norm with ``recompute_output=True``, then a linear layer (and its
    bias), owning both passes. The forward runs the norm and the GEMM as their ops do but
    saves the norm's input and statistics only; the backward recomputes the norm's output
    for the weight gradient (the same kernel, and under FP8 the forward's scale: the same
    bits) and then runs the norm's backward. One activation less between the passes (the
    norm's output, or under FP8 its transposed FP8 copy) for one more norm pass in the
    backward: Megatron's selective recompute of the norm, what torch.compile's partitioner
    does by default.

    Pattern: ``RMSNorm | LayerNorm (recompute_output=True), BasicLinear, Bias?``.
    A column-parallel layer's dgrad is summed over its group inside the stage, as
    BasicLinear's is. Refused for sequence parallelism (the recomputation would gather the
    norm's output again) and row-parallel layers, and where the weight needs no gradient
    (nothing of the norm's output would be saved). The gradients are those of the basic
    ops, bit for bit, in high precision and under FP8.
    """

    direction = "both"
    pattern = Pattern(Op((RMSNorm, LayerNorm), name="norm", recompute_output=True),
                      Op(BasicLinear, name="linear"), Op(Bias, name="bias", optional=True))
    fwd_args_type = NormLinearForwardArgs
    bwd_args_type = NormLinearBackwardArgs
    saved_type = NormLinearSaved
    handles_communication = True  # a column-parallel dgrad's all-reduce, in gemm_backward
    # the norm's output and the linear's dgrad are rounded, as the ops' own stages do
    rounds_output_after = ("norm",)
    rounds_gradient_before = ("linear",)

    @classmethod
    def accepts(cls, match, env):
        linear = match["linear"]
        if linear.parallel.active and (linear.parallel.mode != "column" or linear.parallel.gathers_input):
            return (f"{linear.describe()} is row-parallel or sequence-parallel: only a "
                    f"column-parallel layer without sequence parallelism recomputes its input "
                    f"locally")
        if match["norm"].sequence_parallel:
            return f"{match['norm'].describe()} is sequence-parallel"
        if not env.needs[match.indices[1]].params[0]:
            return (f"{linear.describe()}'s weight needs no gradient: the norm's output "
                    f"would not be saved")
        recipe = env.recipe_of(match.indices[1])  # the linear's (None: kept in bf16)
        fmt = None if recipe is None else recipe.input_format()
        if fmt is not None and (not fmt.per_tensor or fmt.stateful):
            how = "from an amax history" if fmt.stateful else f"{fmt.granularity}"
            return (f"under {recipe.name} scaling the norm's output is cast {how}: its "
                    f"recomputation would not give the forward's bits (recompute_output "
                    f"needs per-tensor current scaling), so the ops run as their own stages")
        return True

    def input_format(self, recipe, needs):
        return None  # the norm reads its input in high precision

    def grad_format(self, recipe, needs):
        # With a Bias, dbias sums dy in high precision (the GEMMs quantize it inside)
        return None if len(needs) == 3 else gemm_grad_format(recipe, needs[1])

    def forward_args(self, input, params, extra_inputs, ctxs):
        norm = self.match["norm"]
        k = len(norm.param_names)
        norm_bias = params[1] if k == 2 else None
        bias = params[k + 1] if len(params) > k + 1 else None
        recipe = ctxs[1].recipe
        return NormLinearForwardArgs(
            input, params[0], norm_bias, params[k], bias, list(norm.normalized_shape),
            norm.eps, norm.zero_centered_gamma,
            bound_format(gemm_input_format(recipe, ctxs[1].needs), ctxs[1], "input"),
            None if recipe is None else bound_format(recipe.weight_format(), ctxs[1], "weight"),
            self.match["linear"].parallel)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        center = args.norm_bias is not None
        gamma = effective_gamma(args.norm_weight, args.zero_centered_gamma)
        norm = (args.input, gamma, args.norm_bias, args.normalized_shape, args.eps, center)
        fp8, fmt = (), args.input_format
        if fmt is None:
            y, mean, rstd = norm_forward(*norm)
        else:  # no transposed copy: the backward recomputes the one wgrad reads
            fmt = fmt.rowwise()
            y, mean, rstd, y_amax = norm_forward_fp8_keeping_amax(*norm, fmt)
        out, kept = gemm_forward(GemmForwardArgs(y, args.linear_weight, fmt,
                                                 args.weight_format, args.parallel), args.bias)
        if args.input_format is not None:
            fp8 = (y_amax, kept[1])  # the weight's amax: the backward quantizes it by it
        return ForwardResult(out, (), ((rstd,) if mean is None else (mean, rstd)) + fp8)

    def save_for_backward(self, args, result, ctxs):
        norm_needs, linear_needs = ctxs[0].needs, ctxs[1].needs
        keep_norm = norm_needs.any or linear_needs.params[0]
        if not (keep_norm or linear_needs.input):
            return
        n = 2 if args.norm_bias is not None else 1
        mean, rstd = (None, *result.aux[:1]) if n == 1 else result.aux[:2]
        y_amax, w_amax = result.aux[n:] if args.input_format is not None else (None, None)
        ctxs[0].saved = NormLinearSaved(
            *((args.input, mean, rstd, args.norm_weight, args.norm_bias) if keep_norm
              else (None,) * 5),
            args.linear_weight if linear_needs.input else None,
            y_amax if linear_needs.params[0] else None,
            w_amax if linear_needs.input else None)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        norm, linear, recipe = self.match["norm"], self.match["linear"], ctxs[1].recipe
        needs = ctxs[1].needs
        return NormLinearBackwardArgs(
            grad_output, ctxs[0].saved, list(norm.normalized_shape), norm.eps,
            norm.zero_centered_gamma, [ctxs[0].needs.input, *ctxs[0].needs.params],
            [needs.input, needs.params[0], *(c.needs.params[0] for c in ctxs[2:])],
            linear.wgrad_dtype, gemm_input_format(recipe, needs),
            bound_format(gemm_grad_format(recipe, needs), ctxs[1], "grad"),
            None if recipe is None else recipe.weight_format(), linear.parallel)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        saved, dy = args.saved, args.grad_output
        dgrad, wgrad, *bias_needs = args.linear_needs
        gamma = None if saved.norm_weight is None else effective_gamma(
            saved.norm_weight, args.zero_centered_gamma)
        y = cls._output_again(args, gamma) if wgrad else None
        d_norm, dw = gemm_backward(GemmBackwardArgs(
            dy, y, saved.linear_weight, args.grad_format, dgrad, wgrad, args.parallel,
            weight_format=args.weight_format, weight_amax=saved.weight_amax,
            wgrad_dtype=args.wgrad_dtype))
        del y
        linear_grads = (dw, *(bias_grad(dy) if need else None for need in bias_needs))
        norm_grads = cls._norm_backward(args, d_norm, gamma)
        return BackwardResult(norm_grads[0], (*norm_grads[1:], *linear_grads))

    @staticmethod
    def _output_again(args, gamma):
        """The norm's output as the forward's GEMM read it, bit for bit (under FP8 only the
        transposed copy the weight gradient reads); ``gamma``: what the norm multiplies by."""
        saved = args.saved
        center = saved.norm_bias is not None
        if args.input_format is None:
            return norm_forward(saved.input, gamma, saved.norm_bias, args.normalized_shape,
                                args.eps, center)[0]
        return norm_output_fp8_again(saved.input, gamma, saved.norm_bias, saved.mean,
                                     saved.rstd, saved.output_amax, args.normalized_shape,
                                     args.eps, center, args.input_format)

    @staticmethod
    def _norm_backward(args, d_norm, gamma) -> tuple:
        """``(dx, dweight[, dbias])`` of the norm (None where not needed)."""
        saved, needs = args.saved, args.norm_needs
        if d_norm is None:  # the norm needs nothing
            return (None,) * len(needs)
        if saved.norm_bias is not None:
            dx, dw, db = layer_norm_backward(d_norm, saved.input, saved.mean, saved.rstd, gamma,
                                             saved.norm_bias, args.normalized_shape, needs)
            return dx, None if dw is None else dw.to(saved.norm_weight.dtype), db
        dx, dw = rms_norm_backward(d_norm, saved.input, saved.rstd, gamma,
                                   args.normalized_shape, *needs)
        return dx, None if dw is None else dw.to(saved.norm_weight.dtype)

    @classmethod
    def example(cls):
        return Example((RMSNorm(32, recompute_output=True), BasicLinear(32, 48)), (2, 8, 32),
                       fp8_recipes=("tensorwise",))
