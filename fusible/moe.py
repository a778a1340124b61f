"""Token routing for mixtures of experts, around :class:`fusible.ops.GroupedLinear`.

A layer routes each token to ``k`` experts (:func:`route_top_k`), sorts the token copies
by expert (:func:`permute_tokens`, which also gives each expert's token count, the
``splits`` GroupedLinear takes), runs the experts on the sorted copies, and combines each
token's ``k`` results weighted by the router (:func:`unpermute_tokens`). Differentiable,
deterministic and traceable: the counts stay on the device, so a compiled layer does not
recompile when the routing changes.
Dropless by default (every token reaches its ``k`` experts, each expert gets as many
copies as are routed to it); with a capacity, each expert gets exactly ``capacity`` rows
(static shapes: its first copies in token order, zero rows after them) and the copies
beyond it are dropped (they contribute nothing to their token's output). With ``align``
each expert's rows are padded with zero rows to a multiple of it (FP8 grouped GEMMs need
16), the last expert taking the spare rows of a static upper bound.
The index maps (:class:`Routing`) are small integer tensors; the rows move in one pass
each way, forward and backward (:mod:`fusible.functional.moe_rows`: every output row is
read from its source rows, so no gradient is summed by atomics, sorted or scattered).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from fusible.functional import moe_rows, parallel

Tensor = torch.Tensor


class Routing(NamedTuple):
    """Where each token's copies went (a named tuple: dynamo traces it).

    Attributes
    ----------
    order : Tensor
        (tokens * k,) int64: for each sorted copy, its copy in token-major order (token
        ``t``'s ``j``-th copy is copy ``t * k + j``).
    splits : Tensor
        (num_experts,) int64: how many rows each expert gets, in expert order.
    k : int
        Experts per token.
    copy_row : Tensor
        (tokens * k,) int64: the row of the experts' input holding each copy (token-major),
        -1 for a dropped copy.
    row_copy : Tensor
        (rows,) int64: the copy each row of the experts' input holds, -1 for a padding or
        empty row.
    slot : Tensor or None
        With a capacity or an alignment: (tokens * k,) int64, each sorted copy's row among
        the ``rows`` the experts see, ``rows`` for a dropped copy. None: the experts see
        the sorted copies themselves.
    capacity : int
        The rows per expert with a capacity (0: none).
    rows : int
        With ``slot``: how many rows the experts see (a static size).
    """

    order: Tensor
    splits: Tensor
    k: int
    copy_row: Tensor
    row_copy: Tensor
    slot: Optional[Tensor] = None
    capacity: int = 0
    rows: int = 0


class _DispatchTokens(torch.autograd.Function):
    """The experts' input rows from the tokens (each a copy of its token, or zeros): one
    gather; its gradient sums each token's copies, one gather too (no atomics, no sort,
    no scatter: what autograd's own ``index`` and ``index_select`` backward cost)."""

    @staticmethod
    def forward(ctx, x, row_copy, copy_row, k):
        ctx.save_for_backward(copy_row)
        ctx.k = k
        return moe_rows.gather_rows(x, row_copy, k)[0]

    @staticmethod
    def backward(ctx, grad):
        (copy_row,) = ctx.saved_tensors
        return moe_rows.combine_rows(grad, copy_row.view(-1, ctx.k)), None, None, None


class _CombineCopies(torch.autograd.Function):
    """Each token's output, the router-weighted sum of its copies' rows (one gather);
    gradients: each row its token's gradient times its weight, the weights' the rows'
    dot products with it, in one gather."""

    @staticmethod
    def forward(ctx, y, weights, copy_row, row_copy, k):
        ctx.need_dw = weights is not None and ctx.needs_input_grad[1]
        # the rows only for the weights' gradient (the experts' whole output otherwise)
        ctx.save_for_backward(y if ctx.need_dw else None, weights, row_copy)
        ctx.k = k
        w = None if weights is None else weights.reshape(-1, k)
        return moe_rows.combine_rows(y, copy_row.view(-1, k), w)

    @staticmethod
    def backward(ctx, grad):
        y, weights, row_copy = ctx.saved_tensors
        flat = None if weights is None else weights.reshape(-1)
        dy, dots = moe_rows.gather_rows(grad, row_copy, ctx.k, flat, y)
        dw = dots.to(weights.dtype).view_as(weights) if ctx.need_dw else None
        return dy, dw, None, None, None


def route_top_k(logits: Tensor, k: int, *, normalize: bool = True) -> tuple:
    """``(experts, weights)``, each (tokens, k): each token's ``k`` highest-scoring experts
    and their softmax probabilities (renormalised over the ``k`` when ``normalize``, as
    Mixtral does; DeepSeek-V3 and Qwen3 likewise).

    Raises ValueError unless ``0 < k <= num_experts``.
    """
    num_experts = logits.shape[-1]
    if not 0 < k <= num_experts:
        raise ValueError(f"route_top_k: k must be in 1..{num_experts} (the experts), got {k}")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights.to(logits.dtype)


def permute_tokens(x: Tensor, experts: Tensor, num_experts: int, *,
                   capacity_factor: Optional[float] = None, align: int = 1) -> tuple:
    """``(rows, Routing)``: each token of ``x`` (tokens, features) copied once per expert
    in ``experts`` (tokens, k), the copies sorted by expert (stably: tokens in order
    within an expert); ``routing.splits`` is how many rows each expert gets, what
    :class:`~fusible.ops.GroupedLinear` takes.

    ``capacity_factor``: each expert gets ``ceil(capacity_factor * tokens * k /
    num_experts)`` rows (rounded up to ``align``), filled with its first copies (zeros
    after them); the copies beyond are dropped. The result then has ``num_experts *
    capacity`` rows whatever the routing. ``align``: every expert's row count a multiple
    of it (``16`` for FP8 grouped GEMMs), padded with zero rows; dropless, the result has
    the static ``round_up(tokens * k + num_experts * (align - 1), align)`` rows, the spare
    ones given to the last expert.
    """
    if experts.dim() != 2 or experts.shape[0] != x.shape[0]:
        raise ValueError(f"permute_tokens: experts must be (tokens, k) = ({x.shape[0]}, k), got "
                         f"{tuple(experts.shape)}")
    if not (isinstance(align, int) and align >= 1):
        raise ValueError(f"permute_tokens: align must be a positive int, got {align!r}")
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    torch._assert_async(((flat >= 0) & (flat < num_experts)).all(),
                        f"permute_tokens: expert indices must be in 0..{num_experts - 1}")
    order = torch.argsort(flat, stable=True)
    splits = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    splits.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    if capacity_factor is None and align == 1:
        slot, capacity, rows = None, 0, tokens * k
        row_copy = order
        copy_row = moe_rows.inverse_permutation(order)
    else:
        sorted_experts = flat[order]
        if capacity_factor is not None:
            if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
                raise ValueError(f"permute_tokens: capacity_factor must be positive and "
                                 f"finite (None: dropless, every copy kept), got "
                                 f"{capacity_factor}")
            capacity = _round_up(math.ceil(capacity_factor * tokens * k / num_experts), align)
            rows = num_experts * capacity
            slot = _capacity_slots(sorted_experts, splits, capacity, num_experts)
            splits = torch.full_like(splits, capacity)
        else:
            capacity, rows = 0, _round_up(tokens * k + num_experts * (align - 1), align)
            slot, splits = _aligned_slots(sorted_experts, splits, align, rows)
        row_copy, copy_row = _row_maps(order, slot, rows)
    routing = Routing(order, splits, k, copy_row, row_copy, slot, capacity, rows)
    return _DispatchTokens.apply(x, row_copy, copy_row, k), routing


def _row_maps(order: Tensor, slot: Tensor, rows: int) -> tuple:
    """``(row_copy, copy_row)`` of :class:`Routing` from the sorted copies' slots (``rows``
    for a dropped copy)."""
    kept = slot < rows
    # the dropped copies all land on the spare last entry, which is cut off
    row_copy = torch.full((rows + 1,), -1, dtype=torch.int64, device=order.device)
    row_copy = row_copy.index_copy(0, slot, order)[:-1]
    copy_row = torch.empty_like(order).index_copy_(0, order, torch.where(kept, slot, -1))
    return row_copy, copy_row


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _starts(splits: Tensor) -> Tensor:
    return torch.cumsum(splits, 0) - splits


def _places(sorted_experts: Tensor, splits: Tensor) -> Tensor:
    """Each sorted copy's place among its expert's copies."""
    return torch.arange(sorted_experts.numel(), device=splits.device) \
        - _starts(splits)[sorted_experts]


def _capacity_slots(sorted_experts: Tensor, splits: Tensor, capacity: int,
                    num_experts: int) -> Tensor:
    """Each sorted copy's row ``expert * capacity + its place among the expert's copies``,
    or ``num_experts * capacity`` past the capacity."""
    place = _places(sorted_experts, splits)
    return torch.where(place < capacity, sorted_experts * capacity + place,
                       num_experts * capacity)


def _aligned_slots(sorted_experts: Tensor, splits: Tensor, align: int, rows: int) -> tuple:
    """``(slot, padded splits)``: each expert's run padded to a multiple of ``align``,
    the last expert also taking the rows up to ``rows`` (a multiple of ``align``)."""
    padded = (splits + align - 1) // align * align
    slot = _starts(padded)[sorted_experts] + _places(sorted_experts, splits)
    spare = torch.zeros_like(padded)
    spare[-1] = rows - padded.sum()
    return slot, padded + spare


def unpermute_tokens(y: Tensor, routing: Routing, weights: Optional[Tensor] = None) -> Tensor:
    """``out[t] = sum_j weights[t, j] * y[copy j of token t]``: the experts' outputs
    ``y`` (the rows of :func:`permute_tokens`) back in token order, combined by the
    router's ``weights`` (tokens, k), or summed where the experts applied them already
    (None: a scaled gated unit, :func:`sorted_weights`); a dropped copy contributes
    nothing. Products and sum in float32 (the sum in ``j`` order), rounded once.
    Differentiable in ``y`` and ``weights``."""
    return _CombineCopies.apply(y, weights, routing.copy_row, routing.row_copy, routing.k)


def sorted_weights(weights: Tensor, routing: Routing) -> Tensor:
    """The router's ``weights`` (tokens, k) in the order of the rows the experts see: the
    scales a scaled gated unit (``ops.ScaledSwiGLU`` ...) takes inside the experts (zero
    for the padding and empty rows)."""
    valid = routing.row_copy >= 0
    flat = weights.reshape(-1)[routing.row_copy.clamp(min=0)]
    return torch.where(valid, flat, torch.zeros((), dtype=flat.dtype, device=flat.device))


class ExpertParallel(NamedTuple):
    """An expert-parallel layer's counts and permutations (:func:`expert_parallel`), the
    extra inputs of its Sequential in :meth:`inputs`.

    Attributes
    ----------
    send_counts : Tensor or None
        (world size,): the rows this rank sends to each rank (the dispatch's counts); None
        with a capacity (equal shares: ``ops.AllToAllEqual``).
    regroup : Tensor
        The received rows (by source rank, then local expert) by local expert, then source
        rank: what the local experts read.
    local_splits : Tensor
        (local experts,): each local expert's rows, what its GroupedLinear layers take.
    ungroup : Tensor
        ``regroup``'s inverse: the experts' output rows back by source rank.
    recv_counts : Tensor or None
        (world size,): the rows received from each rank, sent back by the combine; None
        with a capacity.
    """

    send_counts: Optional[Tensor]
    regroup: Tensor
    local_splits: Tensor
    ungroup: Tensor
    recv_counts: Optional[Tensor]

    def inputs(self, grouped_layers: int = 2) -> tuple:
        """The extra inputs in the order the Sequential ``AllToAll, PermuteRows,
        <grouped_layers GroupedLinear layers and ops without extra inputs>, PermuteRows,
        AllToAll`` reads them (with a capacity, ``AllToAllEqual``, which reads none)."""
        counts = self.send_counts is not None
        return ((self.send_counts,) if counts else ()) + (
            self.regroup, *([self.local_splits] * grouped_layers), self.ungroup) + (
            (self.recv_counts,) if counts else ())


def expert_parallel(splits: Tensor, process_group=None, *, capacity: int = 0
                    ) -> ExpertParallel:
    """The counts and permutations that run ``splits.numel()`` experts split over the
    ranks of ``process_group`` (rank ``r`` holds experts ``r * E / W`` to ``(r + 1) * E / W
    - 1``): ``splits`` is this rank's rows per expert (``permute_tokens``'s
    ``routing.splits``, its rows sorted by expert, so the rows for each rank are
    consecutive).

    Dropless (``capacity=0``): the ranks exchange their counts (a small all-to-all) and
    the row total is read on the host, as the all-to-all's sizes are anyway; the layer's
    all-to-alls are ``ops.AllToAll``. With ``align`` in ``permute_tokens`` every local
    expert's rows stay a multiple of it. With a capacity (``routing.capacity``: every
    expert gets that many rows from every rank) nothing is exchanged or read on the host:
    the layer uses ``ops.AllToAllEqual``, and compiles. Every rank must then route the same
    number of tokens with the same capacity factor (one capacity everywhere: a ragged last
    batch must be padded), which nothing checks on the way.

    Raises ValueError unless the experts divide evenly over the ranks.
    """
    parallel.resolve_group("expert_parallel", process_group)  # an error if none
    # the world size alone (dynamo traces it; the group's record is for the eager path)
    ranks, experts = torch.distributed.get_world_size(process_group), splits.numel()
    if experts % ranks:
        raise ValueError(f"expert_parallel: {experts} experts do not divide over "
                         f"{ranks} ranks")
    local = experts // ranks
    if capacity:
        received = torch.full((ranks, local), capacity, dtype=splits.dtype,
                              device=splits.device)
        regroup, ungroup = _regroup(received, ranks * local * capacity)
        return ExpertParallel(None, regroup, received.sum(0), ungroup, None)
    group = parallel.group_config("expert_parallel", None, False, process_group)
    sent = splits.reshape(ranks, local).contiguous()
    received = parallel.all_to_all_equal(sent, group)  # [source rank, local expert]
    regroup, ungroup = _regroup(received, int(received.sum()))
    return ExpertParallel(sent.sum(1), regroup, received.sum(0), ungroup, received.sum(1))


def _regroup(received: Tensor, total: int) -> tuple:
    """``(regroup, ungroup)``: the permutation from rows in blocks by (source rank, local
    expert), ``received[s, e]`` rows each, to blocks by (local expert, source rank), and
    its inverse."""
    starts = (torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)).view_as(received)
    lengths = received.t().reshape(-1)  # by local expert, then source rank
    shift = starts.t().reshape(-1) - (torch.cumsum(lengths, 0) - lengths)
    regroup = torch.repeat_interleave(shift, lengths, output_size=total) \
        + torch.arange(total, device=received.device)
    return regroup, moe_rows.inverse_permutation(regroup)
