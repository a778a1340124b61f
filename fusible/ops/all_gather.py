"""AllGather: every rank's tensor, concatenated along dim 0."""

from __future__ import annotations

from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional import parallel
from fusible.ops.collective import Collective


class AllGather(Collective):
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
        return (shape[0] * self.parallel.world_size, *shape[1:])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(parallel.all_gather(args.input, args.parallel))

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        mine = parallel.rank_slice(args.parallel,
                                   args.grad_output.shape[0] // args.parallel.world_size)
        return BackwardResult(args.grad_output[mine])
