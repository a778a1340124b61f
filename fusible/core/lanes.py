"""The split backward: whether models run now plan their backward in two lanes.

Inside :func:`split_backward` a fusible model's backward runs each stage that can split
as a *dgrad* stage (the input gradients, at once) and a deferred *wgrad* stage (the
parameter gradients), which runs when the caller says (a zero-bubble pipeline schedule's
``backward_weight`` step). The flag is read when a model runs forward and is one of the
conditions its plan, and a compiled model's graph, depend on.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_state = threading.local()


def splitting() -> bool:
    """Whether models run in this thread plan a split backward."""
    return getattr(_state, "split", False)


@contextlib.contextmanager
def split_backward(enabled: bool = True) -> Iterator[None]:
    """Plan the backward of the fusible models run inside the block in two lanes.

    Parameters
    ----------
    enabled : bool
        False plans the usual one-lane backward inside the block (blocks nest).

    Notes
    -----
    Each backward stage that can split (a linear layer's, and the fusions over one)
    computes its input gradient in the backward pass and queues its weight gradient,
    with what it reads (the saved input, and ``dy``: under FP8 already quantized to
    E5M2, the cast done once for both GEMMs). Run the queue with
    :func:`fusible.run_deferred_wgrad`, or take it as one callable with
    :func:`fusible.take_deferred_wgrad` (a pipeline stage's ``dw_builder``); each
    gradient is added into ``param.grad`` (or ``main_grad``) as autograd would.
    A queued gradient not run by the next optimizer step, or by the next forward outside
    this block, is an error. The state is thread-local, like :func:`fusible.autocast`'s.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"split_backward: enabled must be a bool, got {enabled!r}")
    previous = splitting()
    _state.split = enabled
    try:
        yield
    finally:
        _state.split = previous
