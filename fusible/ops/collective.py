"""The base of the collectives (AllReduce, ReduceScatter, AllGather), along dim 0.

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

from fusible.core.arg_types import GroupArg
from fusible.core.example import Example
from fusible.functional import parallel
from fusible.functional.parallel import TensorParallel
from fusible.module import BasicOperation

Tensor = torch.Tensor


@attrs.define
class CollectiveForwardArgs:
    input: Tensor
    parallel: TensorParallel


@attrs.define
class CollectiveBackwardArgs:
    grad_output: Tensor
    parallel: TensorParallel
    need_grad_input: bool


class Collective(BasicOperation, abstract=True):
    """Shared by the three collectives: a process group and no parameters.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group; the default group when None.
    """

    keeps_features = True  # along dim 0: the features stay as they are

    # Typed as StageSpec's, not as these records: AllToAll has its own
    fwd_args_type: ClassVar[Optional[type]] = CollectiveForwardArgs
    bwd_args_type: ClassVar[Optional[type]] = CollectiveBackwardArgs
    # The collective each direction runs, as plans name it (None: none).
    forward_collective: ClassVar[Optional[str]] = None
    backward_collective: ClassVar[Optional[str]] = None

    def __init__(self, process_group: GroupArg = None):
        super().__init__()
        self.parallel = parallel.group_config(type(self).__name__, None, False, process_group)

    @property
    def process_group(self):
        """The group (looked up by name: the op holds only the name)."""
        return parallel.group_of(self.parallel)

    def describe(self) -> str:
        return f"{type(self).__name__}(world_size={self.parallel.world_size})"

    def forward_args(self, input, params, extra_inputs, ctxs):
        return CollectiveForwardArgs(input, self.parallel)

    def save_for_backward(self, args, result, ctxs):
        pass

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        return CollectiveBackwardArgs(grad_output, self.parallel, ctxs[0].needs.input)

    def communication(self, direction, needs=None):
        name = self.forward_collective if direction == "forward" else self.backward_collective
        if not (self.parallel.active and name):
            return ()
        return (("is", f"{name} /{self.parallel.world_size}"),)

    def _check_rows(self, shape) -> None:
        if not shape or shape[0] % self.parallel.world_size:
            raise ValueError(f"{self.describe()} splits dim 0 over the group, got input of "
                             f"shape {tuple(shape)}: dim 0 must divide by "
                             f"{self.parallel.world_size}")

    def reference(self, x, extra_inputs, params):
        if self.parallel.world_size != 1:
            raise NotImplementedError(f"{self.describe()}: the FP64 reference covers a group "
                                      f"of one (tests/test_parallel.py checks larger groups)")
        return x, ()

    @classmethod
    def example(cls):
        """Needs torch.distributed: the test matrices run it in a group of one."""
        return Example((cls(),), (4, 16))
