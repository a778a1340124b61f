"""AllToAll: rows sent to the ranks by counts (a mixture of experts' token dispatch and
combine, expert parallelism)."""

from __future__ import annotations

import attrs
import torch

from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional import parallel
from fusible.functional.parallel import TensorParallel
from fusible.ops.collective import Collective

Tensor = torch.Tensor


@attrs.define
class AllToAllForwardArgs:
    input: Tensor
    send_counts: Tensor
    parallel: TensorParallel


@attrs.define
class AllToAllSaved:
    """The counts both ways (the backward sends the gradients back the way they came)."""

    send_counts: Tensor
    recv_counts: Tensor


@attrs.define
class AllToAllBackwardArgs:
    grad_output: Tensor
    send_counts: Tensor
    recv_counts: Tensor
    parallel: TensorParallel
    need_grad_input: bool


class AllToAll(Collective):
    """Send the first ``send_counts[0]`` rows of the input to rank 0, the next
    ``send_counts[1]`` to rank 1, ...; the output is the rows every rank sent this one, in
    rank order.

    ``model(x, send_counts)``: ``send_counts`` an integer tensor of ``world_size`` counts on
    ``x``'s device, adding up to ``x``'s rows. The ranks exchange their counts first (a
    small all-to-all), and both are read on the host, as an all-to-all's sizes must be
    (a host synchronisation per call, as in every MoE framework's dispatch). Backward: the
    gradients go back the way the rows came. Eager only for now: the output's row count
    depends on the routing (a compiled graph would need it symbolic); plans mark its
    stages EAGER ONLY, and a compiled model breaks the graph there (an error with
    ``fullgraph=True``).

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group; the default group when None.

    See Also
    --------
    fusible.moe.expert_parallel : the counts and permutations of an expert-parallel layer.
    """

    num_extra_inputs = 1
    forward_collective = "all-to-all"
    backward_collective = "all-to-all"
    fwd_args_type = AllToAllForwardArgs
    bwd_args_type = AllToAllBackwardArgs
    saved_type = AllToAllSaved

    def validate(self, shape, dtype, device, extra_inputs=()):
        (counts,) = extra_inputs
        ws = self.parallel.world_size
        if not (isinstance(counts, torch.Tensor) and counts.shape == (ws,)
                and not counts.is_floating_point()):
            got = (f"{counts.dtype} of shape {tuple(counts.shape)}"
                   if isinstance(counts, torch.Tensor) else type(counts).__name__)
            raise TypeError(f"{self.describe()} takes the rows to send to each rank as an "
                            f"integer tensor of shape ({ws},), got {got}")
        if not shape:
            raise ValueError(f"{self.describe()} got a 0-d input; it sends rows (dim 0)")
        return (-1, *shape[1:])  # the rows received: known once the counts are exchanged

    def forward_args(self, input, params, extra_inputs, ctxs):
        return AllToAllForwardArgs(input, extra_inputs[0], self.parallel)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        send = args.send_counts.tolist()
        if sum(send) != args.input.shape[0] or min(send) < 0:
            raise ValueError(f"AllToAll: the send counts {send} must be non-negative and add "
                             f"up to the input's {args.input.shape[0]} rows")
        recv_counts = parallel.all_to_all_equal(args.send_counts, args.parallel)
        y = parallel.all_to_all(args.input, send, recv_counts.tolist(), args.parallel)
        return ForwardResult(y, (), (recv_counts,))

    def compile_unsupported_reason(self, direction):
        return ("its output's row count depends on the routing, which a compiled graph "
                "would need symbolic (not yet)")

    def save_for_backward(self, args, result, ctxs):
        if ctxs[0].needs.input:
            ctxs[0].saved = AllToAllSaved(args.send_counts, result.aux[0])

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        saved = ctxs[0].saved
        return AllToAllBackwardArgs(grad_output, saved.send_counts, saved.recv_counts,
                                    self.parallel, ctxs[0].needs.input)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None, (), (None,))
        dx = parallel.all_to_all(args.grad_output, args.recv_counts.tolist(),
                                 args.send_counts.tolist(), args.parallel)
        return BackwardResult(dx, (), (None,))

    @classmethod
    def example(cls):
        """Needs torch.distributed: the test matrices run it in a group of one."""
        return Example((cls(),), (4, 16), extra_input_values=(torch.tensor([4]),), fp8=False)


class AllToAllEqual(Collective):
    """Send an equal share of the input's rows to every rank (the first ``rows / world_size``
    to rank 0, ...); the output is the shares every rank sent this one, in rank order, as
    many rows as the input. Backward: the same exchange of the gradients, which sends each
    share back.

    No counts, so no host synchronisation and static shapes: it compiles (one custom op,
    no graph break) and suits CUDA graphs. Every rank must send as many rows (nothing
    checks it: unequal shares fail or hang in the collective). In an expert-parallel layer
    with a capacity (``fusible.moe.permute_tokens(..., capacity_factor=...)``, every
    expert the same rows) it dispatches and combines the tokens
    (:func:`fusible.moe.expert_parallel`).

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group; the default group when None.
    """

    forward_collective = "all-to-all (equal)"
    backward_collective = "all-to-all (equal)"

    def validate(self, shape, dtype, device, extra_inputs=()):
        self._check_rows(shape)
        return tuple(shape)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(parallel.all_to_all_equal(args.input, args.parallel))

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        if not args.need_grad_input:
            return BackwardResult(None)
        return BackwardResult(parallel.all_to_all_equal(args.grad_output, args.parallel))
