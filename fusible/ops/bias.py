"""Bias: ``y = x + bias`` along the last dimension."""

from __future__ import annotations

import attrs
import torch
from torch import nn

from fusible.core.arg_types import DTypeArg, DeviceArg, GroupArg
from fusible.core import checks
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional import parallel
from fusible.functional.linear import bias_grad
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class BiasForwardArgs:
    input: Tensor
    bias: Tensor


@attrs.define
class BiasBackwardArgs:
    grad_output: Tensor
    need_grad_input: bool
    need_grad_bias: bool


class Bias(BasicOperation):
    """``y = x + bias``, ``bias`` of shape (size,), broadcast over leading dimensions.

    Parameters
    ----------
    size : int
        Size of the last dimension.
    tensor_parallel : bool
        The input is a column-parallel output: ``bias`` holds this rank's slice,
        ``size / world_size`` values from ``rank * size / world_size`` (``size`` is global).
    tensor_parallel_group : torch.parallel.ProcessGroup, optional
        The group of ``tensor_parallel`` or ``sequence_parallel``; the default group when None.
    sequence_parallel : bool
        The input's tokens (dim 0) are split over the group, as after a row-parallel
        layer's reduce-scatter: each rank sums only its tokens, so ``dbias`` is summed
        over the group too (the fuser all-reduces it after the backward stage).
    device, dtype
        Where and in which dtype to create ``bias`` (initialised to zeros).

    Notes
    -----
    Saves nothing: ``dbias`` is the gradient summed over tokens and ``dx = dy``.
    """

    keeps_features = True

    param_names = ("bias",)
    attribute_checks = {"size": checks.positive_int("size")}
    fwd_args_type = BiasForwardArgs
    bwd_args_type = BiasBackwardArgs

    def __init__(self, size: int, *, tensor_parallel: bool = False,
                 tensor_parallel_group: GroupArg = None, sequence_parallel: bool = False,
                 device: DeviceArg = None, dtype: DTypeArg = None):
        super().__init__()
        self.size = size
        tensor_parallel = bool(checks.boolean("tensor_parallel")("Bias", tensor_parallel))
        sequence_parallel = bool(checks.boolean("sequence_parallel")("Bias", sequence_parallel))
        if tensor_parallel and sequence_parallel:
            raise ValueError(f"Bias({size=}): a column-parallel output (tensor_parallel) has "
                             f"all tokens; sequence_parallel is for a replicated bias after a "
                             f"row-parallel reduce-scatter")
        label = _label(size, tensor_parallel, sequence_parallel)
        if tensor_parallel:  # this rank's slice of a column-parallel output's bias
            self.parallel = parallel.tensor_parallel(label, "column", False,
                                                     tensor_parallel_group)
        else:  # replicated: with sequence parallelism, its gradient is summed over the group
            self.parallel = parallel.sequence_parallel(label, sequence_parallel,
                                                       tensor_parallel_group)
        self.local_size = (parallel.shard_size(label, "size", self.size, self.parallel)
                           if tensor_parallel else self.size)
        self.bias = nn.Parameter(torch.zeros(self.local_size, device=device, dtype=dtype))

    @property
    def tensor_parallel(self) -> bool:
        """Whether ``bias`` is this rank's slice of a column-parallel output's."""
        return self.parallel.mode == "column"

    @property
    def sequence_parallel(self) -> bool:
        """Whether the input's tokens are split over the group (a replicated bias)."""
        return self.parallel.sequence_parallel

    @property
    def tensor_parallel_group(self):
        """The group of ``tensor_parallel`` or ``sequence_parallel`` (None without them)."""
        return parallel.group_of(self.parallel)

    def describe(self) -> str:
        return _label(self.size, self.tensor_parallel, self.sequence_parallel)

    def validate(self, shape, dtype, device, extra_inputs=()):
        self._check_last_dim(shape, self.local_size,
                             "size / world_size" if self.tensor_parallel else "size")
        self._check_param("bias", self.param("bias"), dtype, device, (self.local_size,))
        return tuple(shape)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return BiasForwardArgs(input, params[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input + args.bias)

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        needs = ctxs[0].needs
        return BiasBackwardArgs(grad_output, needs.input, needs.params[0])

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.grad_output if args.need_grad_input else None,
                              (bias_grad(args.grad_output) if args.need_grad_bias else None,))

    def reference(self, x, extra_inputs, params):
        return x + params[0], ()

    @classmethod
    def example(cls):
        return Example((cls(40),), (2, 3, 40))

    def reset_parameters(self) -> None:
        """Zeros, as the constructor makes them."""
        with torch.no_grad():
            self.bias.zero_()

    def extra_repr(self) -> str:
        return self.describe()[len("Bias("):-1]


def _label(size: int, tensor_parallel: bool, sequence_parallel: bool) -> str:
    flags = "".join(f", {name}=True" for name, on in (("tensor_parallel", tensor_parallel),
                                                      ("sequence_parallel", sequence_parallel))
                    if on)
    return f"Bias(size={size}{flags})"
