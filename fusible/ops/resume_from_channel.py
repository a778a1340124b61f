"""ResumeFromChannel: continue the pipeline from a named channel's tensor, keeping the
stream so far in another channel: what a parallel-residual layer (GPT-NeoX, GPT-J) needs
to run its feed-forward branch on the layer's input after its attention branch."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.module import BasicOperation
from fusible.ops.add_extra_input import AddExtraInput
from fusible.ops.make_extra_output import MakeExtraOutput

Tensor = torch.Tensor


@attrs.define
class ResumeForwardArgs:
    input: Tensor
    resumed: Tensor


@attrs.define
class ResumeBackwardArgs:
    grad_output: Tensor
    grad_kept: Optional[Tensor]
    need_grad_input: bool
    need_grad_resumed: bool


class ResumeFromChannel(BasicOperation):
    """Outputs the tensor of channel ``channel`` (written by a ``MakeExtraOutput`` before it
    in the same Sequential) and hands its own input to channel ``keep_as`` (for an
    ``AddExtraInput`` after it). Saves nothing, computes nothing: the tensors move.

    A parallel-residual layer ``y = x + attn(norm1(x)) + mlp(norm2(x))``::

        MakeExtraOutput(channel="residual"), MakeExtraOutput(channel="mlp_input"),
        norm1, qkv, attention, proj, AddExtraInput(channel="residual"),
        ResumeFromChannel("mlp_input", keep_as="attention"),
        norm2, fc1, activation, fc2, AddExtraInput(channel="attention")

    Parameters
    ----------
    channel : str
        The channel whose tensor the pipeline continues from; it must have the shape,
        dtype and device of this op's input.
    keep_as : str
        The channel this op's input goes to.
    """

    keeps_features = True
    attribute_checks = {"channel": checks.name_string("channel"),
                        "keep_as": checks.name_string("keep_as")}
    num_extra_inputs = 1
    num_extra_outputs = 1
    fwd_args_type = ResumeForwardArgs
    bwd_args_type = ResumeBackwardArgs

    def __init__(self, channel: str, *, keep_as: str):
        super().__init__()
        self.channel, self.keep_as = channel, keep_as
        if channel == keep_as:
            raise ValueError(f"{self.describe()}: channel and keep_as must differ, both are "
                             f"{channel!r}")

    @property
    def write_channel(self) -> str:
        """The channel its extra output writes (the planner's name for ``keep_as``)."""
        return self.keep_as

    def describe(self) -> str:
        return (f"ResumeFromChannel({getattr(self, 'channel', None)!r}, "
                f"keep_as={getattr(self, 'keep_as', None)!r})")

    def validate(self, shape, dtype, device, extra_inputs=()):
        (resumed,) = extra_inputs
        if tuple(resumed.shape) != tuple(shape) or resumed.dtype != dtype or \
                resumed.device != device:
            raise ValueError(f"{self.describe()}: channel {self.channel!r} holds a tensor of "
                             f"shape {tuple(resumed.shape)} ({resumed.dtype}, {resumed.device})"
                             f" and its input is {tuple(shape)} ({dtype}, {device}); they must"
                             f" match")
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return ResumeForwardArgs(input, extra_inputs[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.resumed, (args.input,))

    def save_for_backward(self, args, result, ctxs):
        pass

    def inline_when_compiled(self, direction):
        return True  # tensors handed on: no copies when compiled

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        needs = ctxs[0].needs
        return ResumeBackwardArgs(grad_output, grad_extra_outputs[0], needs.input,
                                  needs.extra_inputs[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        grad_input = args.grad_kept if args.need_grad_input else None
        if grad_input is None and args.need_grad_input:
            grad_input = torch.zeros_like(args.grad_output)  # the kept tensor went unused
        return BackwardResult(grad_input, (),
                              (args.grad_output if args.need_grad_resumed else None,))

    def reference(self, x, extra_inputs, params):
        return extra_inputs[0], (x,)

    @classmethod
    def example(cls):
        return Example((MakeExtraOutput(channel="side"), cls("side", keep_as="main"),
                        AddExtraInput(channel="main")), (2, 3, 16))
