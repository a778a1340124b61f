"""Named extra-tensor channels: MakeExtraOutput(channel=...) hands a tensor to the
AddExtraInput(channel=...) ops after it in the same Sequential (internal residuals,
fan-out), not to the caller; their gradients flow back to it. Checked against the FP64
reference, compiled bit for bit, with the fusions that read or write extra tensors."""

import pytest
import torch
from torch import nn

from fusible import ops
from fusible.testing import check_fusion, exact_parameters_, exact_tensor


def _exact(model):
    torch.manual_seed(0)
    return exact_parameters_(model)


def test_internal_residual():
    """A pre-norm residual block as one Sequential: no extra input or output for the
    caller, the second GEMM accumulating into the channel's tensor."""
    model = _exact(ops.Sequential(ops.MakeExtraOutput(channel="residual"), ops.LayerNorm(16),
                                  ops.Linear(16, 32), ops.GELU(approximate="tanh"),
                                  ops.Linear(32, 16), ops.AddExtraInput(channel="residual")))
    x = exact_tensor((3, 4, 16)).requires_grad_()
    y = model(x)
    assert type(y) is torch.Tensor and y.shape == x.shape
    check_fusion(model, x, forward=["ForwardLinearBiasAdd"], backward=["BackwardLinearBias"])


def test_fan_out_sums_the_readers_gradients():
    model = _exact(ops.Sequential(ops.MakeExtraOutput(channel="a"), ops.Linear(16, 16),
                                  ops.AddExtraInput(channel="a"), ops.Linear(16, 16),
                                  ops.AddExtraInput(channel="a")))
    x = exact_tensor((8, 16)).requires_grad_()
    check_fusion(model, x, forward=["ForwardLinearBiasAdd"])
    x2 = x.detach().clone().requires_grad_()
    first, second = model[1], model[3]
    with torch.no_grad():
        want = second(first(x2) + x2) + x2
    torch.testing.assert_close(model(x), want)


def test_channels_beside_the_callers_extra_tensors():
    """The caller passes and receives only the unnamed extra tensors, in order; the dgrad
    GEMM accumulates into a channel's gradient (BackwardLinearAdd)."""
    model = _exact(ops.Sequential(ops.MakeExtraOutput(), ops.MakeExtraOutput(channel="c"),
                                  ops.BasicLinear(16, 16), ops.AddExtraInput(),
                                  ops.AddExtraInput(channel="c")))
    x = exact_tensor((8, 16)).requires_grad_()
    r = exact_tensor((8, 16)).requires_grad_()
    y, branch = model(x, r)
    torch.testing.assert_close(branch, x)
    torch.testing.assert_close(y, x @ model[2].weight.t() + r + x)
    check_fusion(model, x, r, backward=["BackwardLinearAdd"])


def test_gradient_needs_follow_the_channel():
    """An input that needs no gradient gives a channel that needs none: only the weight's
    gradient is computed."""
    model = _exact(ops.Sequential(ops.MakeExtraOutput(channel="r"), ops.BasicLinear(8, 8),
                                  ops.AddExtraInput(channel="r")))
    x = exact_tensor((4, 8))
    plan = model.plan(x)
    assert plan.op_needs[2].extra_inputs == (False,) and not plan.op_needs[0].input
    model(x).sum().backward()
    assert model[1].weight.grad is not None


def test_channel_errors_name_the_op():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"AddExtraInput\(channel='r'\) at \[1\] reads channel "
                                         r"'r', which no MakeExtraOutput before it"):
        ops.Sequential(ops.GELU(), ops.AddExtraInput(channel="r"))(x)
    with pytest.raises(ValueError, match=r"MakeExtraOutput\(channel='r'\) at \[0\] writes "
                                         r"channel .r., which no AddExtraInput after it in "
                                         r"the same group reads"):
        ops.Sequential(ops.MakeExtraOutput(channel="r"), ops.GELU())(x)
    with pytest.raises(ValueError, match=r"at \[1\] writes channel 'r', which "
                                         r"MakeExtraOutput\(channel='r'\) at \[0\] writes"):
        ops.Sequential(ops.MakeExtraOutput(channel="r"), ops.MakeExtraOutput(channel="r"),
                       ops.AddExtraInput(channel="r"))(x)
    with pytest.raises(ValueError, match="same group"):  # split by an ordinary module
        ops.Sequential(ops.MakeExtraOutput(channel="r"), nn.Tanh(),
                       ops.AddExtraInput(channel="r"))(x)
    with pytest.raises(ValueError, match="in_place"):
        ops.AddExtraInput(channel="r", in_place=True)
    with pytest.raises(TypeError, match="channel must be a non-empty str"):
        ops.AddExtraInput(channel="")
    with pytest.raises(ValueError, match=r"AddExtraInput got extra input of shape \(4, 8\) "
                                         r"for an input of shape \(4, 16\)"):
        ops.Sequential(ops.MakeExtraOutput(channel="r"), ops.BasicLinear(8, 16),
                       ops.AddExtraInput(channel="r"))(x)


def test_a_fusion_covering_a_channels_writer_and_reader_is_refused(plugins):
    """The executor passes channels between stages: a plugin fusion covering both ends
    would lose the channel (its gradient silently), so the plan is an error."""
    import attrs
    from fusible import Example, FusedOperation, Op, Pattern
    from fusible.ops import BackwardResult

    @attrs.define
    class Args:
        grad_output: torch.Tensor

    class BranchAndAdd(FusedOperation):
        direction = "backward"
        pattern = Pattern(Op(ops.MakeExtraOutput, name="branch"),
                          Op(ops.AddExtraInput, name="add"))
        bwd_args_type = Args

        @classmethod
        def backward_compute(cls, args, *, in_custom_op=False):
            return BackwardResult(args.grad_output)

        def backward_args(self, grad_output, grad_extra_outputs, ctxs):
            return Args(grad_output)

        @classmethod
        def example(cls):
            return Example((ops.MakeExtraOutput(), ops.AddExtraInput()), (4, 8), ((4, 8),))

    plugins.fusion(BranchAndAdd)
    model = ops.Sequential(ops.MakeExtraOutput(channel="r"), ops.AddExtraInput(channel="r"))
    with pytest.raises(ValueError, match=r"covers both the writer and a reader of channel 'r'"):
        model(torch.randn(4, 8, requires_grad=True))
