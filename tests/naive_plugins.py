"""Plugin fusions written as a newcomer would, shared by the tests that check how the
planner and the runtime treat them."""

import attrs
import torch

import fusible
from fusible import ops
from fusible.functional.linear_records import LinearSaved
from fusible.ops.pointwise_activation import ActivationSaved


@attrs.define
class GeluOfLinearArgs:
    input: torch.Tensor
    weight: torch.Tensor


class GeluOfLinear(fusible.FusedOperation):
    """``gelu(x @ w.T)`` that knows nothing of tensor parallelism or FP8 (it declares no
    formats), but saves the basic ops' records."""

    direction = "forward"
    pattern = fusible.Pattern(fusible.Op(ops.BasicLinear), fusible.Op(ops.GELU))
    fwd_args_type = GeluOfLinearArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        return GeluOfLinearArgs(input, params[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        h = args.input @ args.weight.t()
        return ops.ForwardResult(torch.nn.functional.gelu(h), (), (h,))

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = LinearSaved(args.input, args.weight)
        ctxs[1].saved = ActivationSaved(result.aux[0])


class GeluOfLinearWrongLayout(GeluOfLinear):
    """The same, saving a tuple where BasicLinear reads its LinearSaved."""

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = (args.input, args.weight)


class ActivationBiasKeepdim(fusible.FusedOperation):
    """Bias + ReLU backward that sums the bias gradient with keepdim=True: shape (1, n) for
    a bias of shape (n,), which autograd alone would sum down silently."""

    direction = "backward"
    pattern = fusible.Pattern(fusible.Op(ops.Bias), fusible.Op(ops.ReLU))
    bwd_args_type = GeluOfLinearArgs  # (grad_output, saved output): two tensors
    priority = 1  # over the built-in BackwardActivationBias

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return GeluOfLinearArgs(grad_output, ctxs[1].saved.tensor)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        dy = args.input * (args.weight > 0)
        return ops.BackwardResult(dy, (dy.sum(0, keepdim=True),))
