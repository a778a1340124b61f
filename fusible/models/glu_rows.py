"""The rows of a gated unit's producer (``[a | b]``: the two halves one after the other)
reordered into the interleaved blocks that a gated unit constructed with a
``glu_interleave_size`` takes, and back."""

from __future__ import annotations

import torch


def interleave_glu_rows(t: torch.Tensor, glu_interleave_size: int) -> torch.Tensor:
    """The rows of ``t`` (a gated unit's producer's weight, ``2F x in``, or bias, ``2F``),
    laid out as ``[a | b]`` (the two halves one after the other), reordered into
    alternating blocks of ``glu_interleave_size`` rows: ``[a_1..a_s, b_1..b_s, a_s+1..]``,
    the layout of a gated unit constructed with that ``glu_interleave_size``.

    What a gated unit after a column-parallel layer needs: with ``s`` dividing half of each
    rank's rows, every rank's contiguous slice of the interleaved rows holds whole pairs.
    Returns a new tensor; the inverse is ``deinterleave_glu_rows``.
    """
    rows, s = _glu_rows(t, glu_interleave_size, "interleave_glu_rows")
    return t.reshape(2, rows // (2 * s), s, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def deinterleave_glu_rows(t: torch.Tensor, glu_interleave_size: int) -> torch.Tensor:
    """The inverse of :func:`interleave_glu_rows`: ``[a | b]`` rows back from blocks."""
    rows, s = _glu_rows(t, glu_interleave_size, "deinterleave_glu_rows")
    return t.reshape(rows // (2 * s), 2, s, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _glu_rows(t: torch.Tensor, size: int, name: str) -> tuple:
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{name}: glu_interleave_size must be a positive int, got {size!r}")
    if t.dim() == 0 or t.shape[0] % (2 * size):
        raise ValueError(f"{name}: the rows of a {tuple(t.shape)} tensor must be a multiple "
                         f"of 2 * glu_interleave_size = {2 * size}")
    return t.shape[0], size
