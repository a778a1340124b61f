"""RecomputeGluLinear: a joint fusion that recomputes a gated unit's output in the backward
instead of saving it for the linear layer after it."""

from typing import Optional

import attrs
import torch

from fusible import Example, FusedOperation, Op, Pattern
from fusible.functional.activations import glu_backward_with_output, glu_forward
from fusible.functional.linear import (bias_grad, gemm_backward, linear_forward,
                                       split_gemm_backward)
from fusible.functional.linear_records import GemmBackwardArgs
from fusible.functional.parallel import TensorParallel
from fusible.ops import (AddExtraInput, BackwardResult, BasicLinear, Bias, ForwardResult,
                         SwiGLU)
from fusible.ops.basic_linear import parallel_refusal
from fusible.ops.glu import GatedActivation

Tensor = torch.Tensor


@attrs.define
class GluLinearForwardArgs:
    input: Tensor
    weight: Tensor
    bias: Optional[Tensor]      # the Bias op's, when the pattern has one
    residual: Optional[Tensor]  # the AddExtraInput op's, when the pattern has one
    kind: str
    interleave: int
    clamp: tuple[float, ...]


@attrs.define
class GluLinearSaved:
    """The unit's input (its gradient, and its output again for the weight gradient) and
    the linear weight (for the dgrad); None where not needed. The unit's output, which the
    basic ops would save, is not kept."""

    input: Optional[Tensor]
    weight: Optional[Tensor]


@attrs.define
class GluLinearBackwardArgs:
    grad_output: Tensor
    saved: GluLinearSaved
    kind: str
    interleave: int
    clamp: tuple[float, ...]
    need_grad_bias: bool
    need_grad_residual: bool
    has_bias: bool
    has_residual: bool
    wgrad_dtype: Optional[torch.dtype]
    consume_input: bool = False  # the record alone holds the unit's input (ctx.owned)


class RecomputeGluLinear(FusedOperation):
    """A joint fusion: a gated unit with ``recompute_output=True``, then a linear layer,
    its bias and a residual add, owning both passes. The forward runs the unit and the GEMM
    as their ops do (the residual as the GEMM's C matrix) but saves the unit's input only;
    the backward runs the dgrad, then one kernel that computes the unit's gradient and
    writes its output again (the forward's bits) for the weight gradient. One activation
    less between the passes (the unit's output, ``tokens x ffn``) for one more write in
    the backward: what torch.compile's partitioner and Liger-Kernel's SwiGLU do.

    Pattern: ``GatedActivation (recompute_output=True), BasicLinear, Bias?,
    AddExtraInput?``. High precision only: under FP8 the linear saves its input as a
    transposed FP8 copy, half the size, which the recomputation would have to cast again
    to the forward's scale; refused there (the ops run as their own stages, the plan says
    why), as are tensor parallelism, an in-place residual, a split backward (the basic ops
    defer the weight gradient), an input or a weight that needs no gradient (the basic ops
    save only the output, or nothing of it) and a unit that caches its input in FP8. The
    gradients are those of the basic ops, bit for bit.
    """

    direction = "both"
    pattern = Pattern(Op(GatedActivation, name="glu", recompute_output=True),
                      Op(BasicLinear, name="linear"), Op(Bias, name="bias", optional=True),
                      Op(AddExtraInput, name="add", optional=True))
    fwd_args_type = GluLinearForwardArgs
    bwd_args_type = GluLinearBackwardArgs
    saved_type = GluLinearSaved
    # the unit's output and the linear's dgrad are rounded, as the ops' own stages do
    rounds_output_after = ("glu",)
    rounds_gradient_before = ("linear",)
    # the unit's gradient written over its input (read no more): the peak of the
    # backward holds one tensor of the input's size less than the basic ops'
    consumable_saved = ("input",)

    @classmethod
    def accepts(cls, match, env):
        linear, add = match["linear"], match["add"]
        refusal = parallel_refusal(linear)
        if refusal is not True:
            return refusal
        glu = match["glu"]
        if glu.num_extra_inputs:
            return f"{glu.describe()} takes router scales"
        if glu.cache_quantized_input:
            return (f"{glu.describe()} saves its input in FP8 (cache_quantized_input), "
                    f"which the recomputation would have to read instead of the input")
        if not env.needs[match.indices[0]].input:
            return (f"{glu.describe()}'s input needs no gradient: the basic ops save only "
                    f"its output, half the size")
        if add is not None and add.in_place:
            return f"{add.describe()} adds in place"
        if not env.needs[match.indices[1]].params[0]:
            return (f"{linear.describe()}'s weight needs no gradient: the unit's output "
                    f"would not be saved")
        if env.conditions.split_backward:
            return (f"the backward is split (fusible.split_backward): {linear.describe()}'s "
                    f"weight gradient is deferred as the basic ops', where it fills a "
                    f"pipeline's bubbles")
        if env.recipe_of(match.indices[1]) is not None:
            return (f"{linear.describe()} runs in FP8: it saves the unit's output as a "
                    f"transposed FP8 copy, which recompute_output does not recompute (high "
                    f"precision only), so the ops run as their own stages")
        return True

    def input_format(self, recipe, needs):
        return None  # the unit reads its input in high precision

    def grad_format(self, recipe, needs):
        return None  # the GEMMs run in high precision (accepts refuses an FP8 linear)

    def forward_args(self, input, params, extra_inputs, ctxs):
        glu = self.match["glu"]
        bias = params[1] if self.match["bias"] is not None else None
        return GluLinearForwardArgs(input, params[0], bias,
                                    extra_inputs[0] if extra_inputs else None, glu.kind,
                                    glu.glu_interleave_size or 0, glu.clamp())

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        h = glu_forward(args.kind, args.input, None, args.interleave, args.clamp)
        # BasicLinear's GEMM, or ForwardLinearBiasAdd's with the residual as its C matrix
        return ForwardResult(linear_forward(h, args.weight, args.bias, args.residual))

    def save_for_backward(self, args, result, ctxs):
        # the unit's input and the weight need gradients (accepts): both are read
        ctxs[0].saved = GluLinearSaved(args.input, args.weight)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        glu, linear = self.match["glu"], self.match["linear"]
        has_bias = self.match["bias"] is not None
        has_residual = self.match["add"] is not None
        return GluLinearBackwardArgs(
            grad_output, ctxs[0].saved, glu.kind, glu.glu_interleave_size or 0, glu.clamp(),
            has_bias and ctxs[2].needs.params[0],
            has_residual and ctxs[-1].needs.extra_inputs[0], has_bias, has_residual,
            linear.wgrad_dtype, "input" in ctxs[0].owned)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        saved, dy = args.saved, args.grad_output
        # BasicLinear's GEMMs as two calls: the unit's output comes between them
        dgrad, wgrad = split_gemm_backward(GemmBackwardArgs(
            dy, None, saved.weight, None, True, True, TensorParallel(),
            wgrad_dtype=args.wgrad_dtype))
        dh, _ = gemm_backward(dgrad)
        # h over dh (read no more), and dx over the input where the record alone held it
        # (never in a compiled stage: a trace's records own nothing, ctx.owned)
        dx, h = glu_backward_with_output(args.kind, dh, saved.input, args.interleave,
                                         args.clamp, consume_grad=True,
                                         consume_input=args.consume_input)
        del dh
        _, dw = gemm_backward(attrs.evolve(wgrad, input=h))
        params = (dw,) + ((bias_grad(dy) if args.need_grad_bias else None,)
                          if args.has_bias else ())
        extras = (dy if args.need_grad_residual else None,) if args.has_residual else ()
        return BackwardResult(dx, params, extras)

    @classmethod
    def example(cls):
        # high precision only: no FP8 example (the fusion refuses an FP8 linear)
        return Example((SwiGLU(recompute_output=True), BasicLinear(16, 32), Bias(32),
                        AddExtraInput()), (4, 32), ((4, 32),), fp8=False)
