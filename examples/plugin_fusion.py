"""A fusion written the way a plugin author would: ConstantScale + Bias in one kernel.

``y = scale * x + bias`` is one ``torch.add(bias, x, alpha=scale)`` instead of a
multiply and an add. Import this module (or list it under the ``fusible.fusions``
entry-point group of your package) and every Sequential with a ConstantScale
followed by a Bias uses it:

    python examples/plugin_fusion.py
"""

import attrs
import torch

from fusible import FusedOperation, Op, Pattern, ops, register_fusion
from fusible.ops import ForwardResult
from fusible.testing import check_fusion, exact_tensor


@attrs.define
class ScaleBiasArgs:
    input: torch.Tensor
    bias: torch.Tensor
    scale: float


@register_fusion
class ForwardScaleBias(FusedOperation):
    """``y = scale * x + bias`` as one ``torch.add(bias, x, alpha=scale)``.

    Pattern: ``ConstantScale, Bias``. Accepts every match.
    Saves: nothing (neither op saves anything); the backward is planned separately.
    """

    direction = "forward"
    pattern = Pattern(Op(ops.ConstantScale, name="scale"), Op(ops.Bias, name="bias"))
    fwd_args_type = ScaleBiasArgs

    def forward_args(self, input, params, extra_inputs, ctxs):
        (bias,) = params  # the covered ops' parameters: Bias's bias
        return ScaleBiasArgs(input, bias, self.match["scale"].scale)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(torch.add(args.bias, args.input, alpha=args.scale))

    def save_for_backward(self, args, result, ctxs):
        pass  # ConstantScale and Bias save nothing


if __name__ == "__main__":
    model = ops.Sequential(ops.BasicLinear(8, 16), ops.ConstantScale(0.5), ops.Bias(16))
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    print(model.plan(x).explain())
    check_fusion(model, exact_tensor((4, 8)).requires_grad_(), forward=["ForwardScaleBias"])
    print("ForwardScaleBias matches the float64 reference")
