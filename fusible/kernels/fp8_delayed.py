"""Delayed scaling's state: the amax history a cast scales by and records into.

A state is one float32 vector of ``2 + history`` values:

* ``state[0]``: the amax the next cast scales by (``scale = FP8_MAX / state[0]``, as
  current scaling's casts derive it from an amax; 0 gives scale 1);
* ``state[1]``: the absolute maximum of the tensor being cast, accumulated by the cast
  (0 between casts);
* ``state[2:]``: the history of recorded amaxes, newest first.

After a cast, :func:`roll` pushes ``state[1]`` onto the history (the oldest drops out),
zeroes it and sets ``state[0]`` to the history's maximum (or its newest value) times
``2 ** margin``; a window whose amax is 0 or not finite keeps the previous ``state[0]``
(TransformerEngine's rule). A cast kernel records and rolls in one launch: each program
folds its tile's amax into ``state[1]`` with an atomic max and counts itself off on a
zeroed ticket; the grid's last program rolls (:func:`record_delayed`). Where the amax
must first be reduced over a process group, the kernel only records and the caller
reduces ``state[1]`` and rolls after it (:func:`finish`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from fusible.kernels import jit, require_triton, tl, triton
from fusible.kernels.fp8_cast import (atomic_amax_of_tile, fp8_buffers, fp8_results,
                                      max_keep_nan, scale_from_amax, store_fp8_tile,
                                      tile_coords, tile_grid, zeroed_amax)

FLOAT32_INF = float("inf")


class DelayedCast(NamedTuple):
    """One cast under delayed scaling: the state it scales by and records into.

    Attributes
    ----------
    state : Tensor
        float32 ``(2 + history,)`` (the module docstring's layout).
    most_recent : bool
        Scale by the newest amax rather than the history's maximum.
    margin : int
        The scale is ``2 ** margin`` times smaller than the amax alone gives.
    reduce : callable or None
        ``t -> t`` maximum over a process group, applied to the recorded amax before it
        joins the history (the kernels then leave the roll to :func:`finish`).
    """

    state: torch.Tensor
    most_recent: bool = False
    margin: int = 0
    reduce: Optional[Callable] = None

    @property
    def history(self) -> int:
        return self.state.shape[0] - 2


def kernel_args(delayed: Optional[DelayedCast], dummy: torch.Tensor) -> dict:
    """The keyword arguments :func:`record_delayed` takes in a cast kernel: those of
    ``delayed``, or, for current scaling (None), arguments that record nothing (``dummy``,
    any tensor of the kernel's, stands for the pointers: DELAYED=False compiles the
    recording out)."""
    if delayed is None:
        return dict(state_ptr=dummy, ticket_ptr=dummy, MARGIN_FACTOR=1.0, DELAYED=False,
                    ROLL=False, MOST_RECENT=False, HISTORY=1, BLOCK_H=1)
    return dict(state_ptr=delayed.state, ticket_ptr=zeroed_amax(delayed.state.device),
                MARGIN_FACTOR=2.0 ** delayed.margin, DELAYED=True,
                ROLL=delayed.reduce is None, MOST_RECENT=delayed.most_recent,
                HISTORY=delayed.history, BLOCK_H=_block(delayed.history))


def scale_amax(delayed: Optional[DelayedCast], device: torch.device, amax_pass) -> torch.Tensor:
    """What a cast kernel scales by: ``delayed``'s state, or, under current scaling, a
    zeroed slot that ``amax_pass(slot)`` first fills with the values' absolute maximum
    (the kernel's first pass)."""
    if delayed is not None:
        return delayed.state
    amax = zeroed_amax(device)
    amax_pass(amax)
    return amax


def _block(history: int) -> int:
    """The roll's chunk: the history up to 128 values, else 128 at a time."""
    return min(triton.next_power_of_2(history), 128)


@jit
def roll_state(state_ptr, MARGIN_FACTOR, MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr,
               BLOCK_H: tl.constexpr):
    """Push ``state[1]`` onto the history and derive ``state[0]`` (one program), the
    history in chunks of ``BLOCK_H`` from its oldest end: each chunk reads the values one
    place newer before any store of it, and every place a chunk stores into was read by
    its own or an older chunk already (registers stay bounded for long histories)."""
    # An atomic read (from L2): the state's line may sit stale in this SM's L1, loaded
    # with state[0] before the other programs' atomics landed.
    current = tl.atomic_max(state_ptr + 1, 0.0)
    amax = current
    chunks = tl.cdiv(HISTORY, BLOCK_H)
    for k in range(chunks):
        offs = (chunks - 1 - k) * BLOCK_H + tl.arange(0, BLOCK_H)  # history places
        older = tl.load(state_ptr + 1 + offs, mask=(offs >= 1) & (offs < HISTORY),
                        other=0.0, cache_modifier=".cg")
        history = tl.where(offs == 0, current, older)
        if not MOST_RECENT:
            amax = tl.maximum(amax, tl.reduce(tl.where(offs < HISTORY, history, 0.0), 0,
                                              max_keep_nan),
                              propagate_nan=tl.PropagateNan.ALL)
        tl.debug_barrier()  # this chunk's loads before its stores
        tl.store(state_ptr + 2 + offs, history, mask=offs < HISTORY)
    previous = tl.load(state_ptr, cache_modifier=".cg")
    derived = amax * MARGIN_FACTOR
    keep = (amax > 0.0) & (derived <= 3.4028234663852886e38)  # finite (False for NaN)
    tl.store(state_ptr + 1, 0.0)
    tl.store(state_ptr, tl.where(keep, derived, previous))


@jit
def record_delayed(v, mask, state_ptr, ticket_ptr, MARGIN_FACTOR, ROLL: tl.constexpr,
                   MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr, BLOCK_H: tl.constexpr):
    """Fold the float32 tile ``v``'s absolute maximum (where ``mask``) into ``state[1]``;
    with ``ROLL`` the grid's last program to count itself off rolls the state."""
    atomic_amax_of_tile(v, mask, state_ptr + 1)
    if ROLL:
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        ticket = tl.atomic_add(ticket_ptr, 1.0)  # acq_rel: after this program's amax
        if ticket == (programs - 1).to(tl.float32):
            roll_state(state_ptr, MARGIN_FACTOR, MOST_RECENT, HISTORY, BLOCK_H)


@jit
def _roll_kernel(state_ptr, MARGIN_FACTOR, MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    roll_state(state_ptr, MARGIN_FACTOR, MOST_RECENT, HISTORY, BLOCK_H)


def roll_torch(state: torch.Tensor, amax: torch.Tensor, most_recent: bool, margin: int) -> None:
    """:func:`roll_state` in PyTorch ops, recording ``amax`` (0-d float32) as the newest
    value (``state[1]`` is not read: this path measures the amax itself)."""
    history = torch.cat([amax.reshape(1).float(), state[2:-1]])
    newest = history[0] if most_recent else history.amax()
    scaled = newest * 2.0 ** margin
    keep = (newest > 0) & (scaled < FLOAT32_INF)
    derived = torch.where(keep, scaled, state[0])
    state[2:] = history
    state[1] = 0.0
    state[0] = derived


def finish(delayed: Optional[DelayedCast]) -> None:
    """After a cast kernel ran with :func:`kernel_args` of ``delayed``: where the amax
    is reduced over a group first, reduce ``state[1]`` and roll (else the kernel rolled;
    current scaling, None: nothing)."""
    if delayed is None or delayed.reduce is None:
        return
    state = delayed.state
    state[1:2] = delayed.reduce(state[1:2])
    _roll_kernel[(1,)](state, 2.0 ** delayed.margin, MOST_RECENT=delayed.most_recent,
                       HISTORY=delayed.history, BLOCK_H=_block(delayed.history), num_warps=1)


@jit
def _delayed_cast_kernel(x_ptr, data_ptr, t_ptr, scale_inv_ptr, M, N, FP8_MAX, state_ptr,
                         ticket_ptr, MARGIN_FACTOR, ROLL: tl.constexpr,
                         MOST_RECENT: tl.constexpr, HISTORY: tl.constexpr,
                         BLOCK_H: tl.constexpr, HAS_T: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    scale = scale_from_amax(state_ptr, FP8_MAX)  # read before the last program rolls
    rows, cols, mask = tile_coords(M, N, BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    store_fp8_tile(x, scale, rows, cols, mask, data_ptr, t_ptr, scale_inv_ptr, M, N, FP8_MAX,
                   HAS_T)
    record_delayed(x, mask, state_ptr, ticket_ptr, MARGIN_FACTOR, ROLL, MOST_RECENT, HISTORY,
                   BLOCK_H)


def cast_delayed_triton(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
                        columnwise: bool, delayed: DelayedCast, block_m: int = 64,
                        block_n: int = 128) -> list:
    """``[data, scale_inv]`` (+ ``transpose``) of the non-empty ``x`` scaled by
    ``delayed``'s state, its amax recorded and the history rolled, in one launch (two
    where the amax is reduced over a group first)."""
    require_triton("cast_delayed_triton")
    x = x.contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    data, transpose, scale_inv, in_kernel_t = fp8_buffers(x, fp8_dtype, columnwise)
    args = kernel_args(delayed, x)
    del args["DELAYED"]  # this kernel always records
    _delayed_cast_kernel[tile_grid(n_rows, n_cols, block_m, block_n)](
        x, data, transpose, scale_inv, n_rows, n_cols, fp8_max, **args, HAS_T=in_kernel_t,
        BLOCK_M=block_m, BLOCK_N=block_n)
    finish(delayed)
    return fp8_results(data, scale_inv, transpose, columnwise, in_kernel_t)
