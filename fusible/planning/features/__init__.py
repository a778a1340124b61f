"""Execution features: what a plan may add to the core records, one feature per module.

A feature is a record, a pass and a runtime module. Its planning pass,
``planning/features/<name>.py``'s ``attach(prep, attached)``, reads the group's core
stages (:class:`~fusible.planning.exec_plan.Preparation`) and the records of the
features before it (``attached``, by name) and returns the feature's record, or None
where the group does not use the feature. The record is the plan's field ``<name>`` of
:class:`Features`, and ``runtime/features/<name>.py`` (the same name) runs it. A new
feature adds its two modules and one field here; the fields' order is the passes'.
"""

from __future__ import annotations

from typing import Optional

import attrs

from fusible.planning.exec_plan import Preparation
from fusible.planning.features import channels as _channels
from fusible.planning.features import grad_reduction as _grad_reduction
from fusible.planning.features import in_place as _in_place
from fusible.planning.features import main_grad as _main_grad
from fusible.planning.features import parallel_agreement as _parallel_agreement
from fusible.planning.features import scaling_states as _scaling_states
from fusible.planning.features import split_backward as _split_backward
from fusible.planning.features import stage_ranges as _stage_ranges


def _feature(attach):
    """A field of :class:`Features`: None unless ``attach`` (the feature's pass) says."""
    return attrs.field(default=None, metadata={"attach": attach})


@attrs.frozen
class Features:
    """The execution features' records of one plan (None: the plan does not use it)."""

    channels: Optional[_channels.Channels] = _feature(_channels.attach)
    in_place: Optional[_in_place.InPlaceExtras] = _feature(_in_place.attach)
    main_grad: Optional[_main_grad.MainGrads] = _feature(_main_grad.attach)
    grad_reduction: Optional[_grad_reduction.GradReduction] = _feature(_grad_reduction.attach)
    scaling_states: Optional[_scaling_states.ScalingStates] = _feature(_scaling_states.attach)
    split_backward: Optional[_split_backward.SplitBackward] = _feature(_split_backward.attach)
    stage_ranges: Optional[_stage_ranges.StageRanges] = _feature(_stage_ranges.attach)
    parallel_agreement: Optional[_parallel_agreement.ParallelAgreement] = _feature(
        _parallel_agreement.attach)

    def active(self) -> list:
        """``(name, record)`` of the features in use, in pass order."""
        return [(f.name, getattr(self, f.name)) for f in attrs.fields(type(self))
                if getattr(self, f.name) is not None]


def attach_features(prep: Preparation) -> Features:
    """Run every feature's pass over the prepared group, in field order."""
    attached: dict = {}
    for field in attrs.fields(Features):
        record = field.metadata["attach"](prep, attached)
        if record is not None:
            attached[field.name] = record
    return Features(**attached)


__all__ = ["Features", "attach_features"]
