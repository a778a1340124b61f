"""FP8 casts with delayed scaling: one scale per tensor, from its role's amax history, the
tensor's own amax recorded in the same pass (the state's layout and its update are
:mod:`fusible.kernels.fp8_delayed`'s)."""

from __future__ import annotations

import torch

from fusible.kernels import fp8_delayed, plain_eager
from fusible.kernels.fp8_delayed import DelayedCast
from fusible.quantization.casts.common import FP8_MAX
from fusible.quantization.casts.tensorwise import cast_tensorwise, tensor_amax


def cast_delayed(x: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool,
                 delayed: DelayedCast) -> list:
    """Cast ``x`` to FP8 with the scale ``delayed``'s state holds, record ``x``'s amax in
    that state and roll it (the next cast's scale).

    Parameters
    ----------
    x, fp8_dtype, columnwise
        As :func:`~fusible.quantization.casts.tensorwise.cast_tensorwise`'s.
    delayed : DelayedCast
        The role's state (updated in place), the history's reduction and margin, and the
        maximum over a process group the amax takes first, if any.

    Returns
    -------
    list
        ``[data, scale_inv]`` (0-d float32) ``+ [transpose]`` with ``columnwise``.

    Notes
    -----
    One Triton kernel on CUDA; elsewhere, and where something may be tracing, PyTorch
    ops and the custom op ``fusible::cast_to_fp8`` (the amax the state holds in place of
    ``x``'s), the same bits.
    """
    if x.is_cuda and fp8_delayed.triton is not None and x.numel() \
            and plain_eager(x, delayed.state):
        return fp8_delayed.cast_delayed_triton(x, fp8_dtype, FP8_MAX[fp8_dtype],
                                               columnwise, delayed)
    parts = cast_tensorwise(x, fp8_dtype, columnwise, delayed.state[0])
    amax = tensor_amax(x)
    if delayed.reduce is not None:
        amax = delayed.reduce(amax)
    fp8_delayed.roll_torch(delayed.state, amax, delayed.most_recent, delayed.margin)
    return parts
