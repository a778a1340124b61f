"""AllReduce: the sum over a process group."""

from __future__ import annotations

from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional import parallel
from fusible.ops.collective import Collective


class AllReduce(Collective):
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
        return ForwardResult(parallel.all_reduce(args.input, args.parallel))

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.grad_output if args.need_grad_input else None)
