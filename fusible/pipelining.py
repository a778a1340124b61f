"""Pipeline parallelism: a fusible model as a stage of ``torch.distributed.pipelining``.

:func:`pipeline_stage` builds a ``PipelineStage`` whose forward runs under
:func:`fusible.split_backward` and whose ``dw_builder`` takes the deferred wgrads. Every
schedule then works: a full backward step (``Schedule1F1B``,
``ScheduleInterleaved1F1B``) runs the dgrad lane and, at once, the wgrads; a
zero-bubble schedule's ``backward_input`` step (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``) runs the dgrad lane only and its ``backward_weight`` step
that microbatch's wgrads. PyTorch's own split of a backward without a ``dw_builder``
runs every autograd node twice, which a fusible group (one node that frees its saved
tensors) cannot.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fusible.core.lanes import split_backward
from fusible.runtime import wgrad


@functools.cache
def _stage_class() -> type:
    """``SplitBackwardStage``: a ``PipelineStage`` whose forwards plan a split backward.
    Made on first use: torch.distributed.pipelining costs 0.8 s of `import fusible`."""
    from torch.distributed.pipelining import PipelineStage

    class SplitBackwardStage(PipelineStage):
        def forward_one_chunk(self, *args, **kwargs):
            with split_backward():
                return super().forward_one_chunk(*args, **kwargs)

    return SplitBackwardStage


def pipeline_stage(submodule: torch.nn.Module, stage_index: int, num_stages: int,
                   device: "torch.device | str | int", **kwargs: Any) -> Any:
    """A pipeline stage of ``submodule`` with its weight gradients deferred where the
    schedule asks.

    Parameters
    ----------
    submodule : torch.nn.Module
        The stage's part of the model: fusible Sequentials, and any ordinary modules
        (whose gradients are computed in the dgrad step, as usual). It may be compiled in
        place (``submodule.compile()``); zero-bubble schedules refuse a
        ``torch.compile(submodule)`` wrapper.
    stage_index, num_stages, device
        As for ``torch.distributed.pipelining.PipelineStage``.
    **kwargs
        The other keyword arguments of ``PipelineStage`` (``group``, ``input_args``,
        ``output_args``, ...), but ``dw_builder``, which this sets.

    Returns
    -------
    torch.distributed.pipelining.PipelineStage
        Of a subclass, ``SplitBackwardStage``, whose forwards run under
        :func:`fusible.split_backward`.

    Notes
    -----
    The deferred wgrads run outside PyTorch's ``backward_maybe_with_nosync``: data
    parallelism's gradient hooks (DDP's, FSDP2's) do not see them, so combine with those
    only through a schedule without a weight step.
    """
    if "dw_builder" in kwargs:
        raise TypeError("pipeline_stage sets dw_builder itself (fusible's deferred wgrads); "
                        "build a PipelineStage directly to pass your own")
    return _stage_class()(submodule, stage_index, num_stages, device,
                          dw_builder=wgrad.take, **kwargs)
