"""Collectives along dim 0, as operations: AllReduce, ReduceScatter, AllGather.

Their backward passes follow tensor parallelism's convention, where a tensor that is
replicated over the group carries the same, complete gradient on every rank, and a
partial tensor (a partial sum, or one rank's slice) the gradient of its own part:

- ``AllReduce`` sums partial tensors into a replicated one; backward: identity.
- ``ReduceScatter`` sums partial tensors and keeps this rank's slice of dim 0;
  backward: all-gather the slices' gradients.
- ``AllGather`` concatenates the slices into a replicated tensor; backward: this
  rank's slice of the (complete, replicated) gradient, no communication.

Under this convention ``AllGather`` + a column-parallel ``BasicLinear`` (which all-reduces
its partial dgrad into the complete one) computes what ``BasicLinear(...,
tensor_parallel_mode="column", sequence_parallel=True)`` computes, with more traffic.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import torch

from fusible import distributed
from fusible.distributed import TensorParallel
from fusible.ops.base import BackwardResult, BasicOperation, ForwardResult, pass_through

Tensor = torch.Tensor


@attrs.define
class CollectiveForwardArgs:
    input: Tensor
    group: TensorParallel


@attrs.define
class CollectiveBackwardArgs:
    grad_output: Tensor
    group: TensorParallel
    need_grad_input: bool


class _Collective(BasicOperation):
    """Shared by the three collectives: a process group and no parameters."""

    fwd_args_type = CollectiveForwardArgs
    bwd_args_type = CollectiveBackwardArgs
    # The collective each direction runs, as plans name it (None: none).
    forward_collective: ClassVar[Optional[str]] = None
    backward_collective: ClassVar[Optional[str]] = None

    def __init__(self, process_group=None):
        super().__init__()
        self.group = distributed.group_config(type(self).__name__, "", False, process_group)

    @property
    def process_group(self):
        """The group (looked up by name: the op holds only the name)."""
        return distributed.group_of(self.group)

    def describe(self) -> str:
        return f"{type(self).__name__}(world_size={self.group.world_size})"

    def forward_args(self, input, params, extra_inputs, ctxs):
        return CollectiveForwardArgs(input, self.group)

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return CollectiveBackwardArgs(grad_output, self.group, ctxs[0].needs.input)

    def communication(self, direction, needs=None):
        name = self.forward_collective if direction == "forward" else self.backward_collective
        if not (self.group.active and name):
            return ()
        return (("is", f"{name} /{self.group.world_size}"),)

    def _check_rows(self, shape) -> None:
        if not shape or shape[0] % self.group.world_size:
            raise ValueError(f"{self.describe()} splits dim 0 over the group, got input of "
                             f"shape {tuple(shape)}: dim 0 must divide by "
                             f"{self.group.world_size}")


def _fresh(t: Tensor, group: TensorParallel, in_custom_op: bool) -> Tensor:
    """``t`` where a group of one made the collective a no-op (copied in a custom op)."""
    return pass_through(t, True, in_custom_op and not group.active)


class AllReduce(_Collective):
    """Sum over the process group (partial sums in, the replicated total out).

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group; the default group when None.

    Notes
    -----
    Backward: identity (every rank holds the complete gradient of the replicated sum).
    """

    forward_collective = "all-reduce"

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(_fresh(distributed.all_reduce(args.input, args.group), args.group,
                                    in_custom_op))

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(pass_through(args.grad_output, args.need_grad_input, in_custom_op))


class ReduceScatter(_Collective):
    """Sum over the process group, keeping this rank's slice of dim 0.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group; the default group when None.

    Notes
    -----
    Dim 0 must divide by the world size. Backward: all-gather along dim 0.
    """

    forward_collective, backward_collective = "reduce-scatter", "all-gather"

    def validate(self, shape, dtype, device, extra_inputs=()):
        self._check_rows(shape)
        return (shape[0] // self.group.world_size, *shape[1:])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(_fresh(distributed.reduce_scatter(args.input, args.group),
                                    args.group, in_custom_op))

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(_fresh(distributed.all_gather(args.grad_output, args.group),
                                     args.group, in_custom_op))


class AllGather(_Collective):
    """Concatenate every rank's tensor along dim 0.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group; the default group when None.

    Notes
    -----
    Backward: this rank's slice of the gradient along dim 0 (the replicated result's
    gradient is complete on every rank).
    """

    forward_collective = "all-gather"

    def validate(self, shape, dtype, device, extra_inputs=()):
        if not shape:
            raise ValueError(f"{self.describe()} got a 0-d input; it gathers along dim 0")
        return (shape[0] * self.group.world_size, *shape[1:])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(_fresh(distributed.all_gather(args.input, args.group), args.group,
                                    in_custom_op))

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        mine = distributed.rank_slice(args.group,
                                      args.grad_output.shape[0] // args.group.world_size)
        return BackwardResult(pass_through(args.grad_output[mine], True, in_custom_op))
