"""ReduceScatter: the sum over a process group, each rank keeping its slice of dim 0."""

from __future__ import annotations

from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional import parallel
from fusible.ops.collective import Collective


class ReduceScatter(Collective):
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
        return (shape[0] // self.parallel.world_size, *shape[1:])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(parallel.reduce_scatter(args.input, args.parallel))

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(parallel.all_gather(args.grad_output, args.parallel))
