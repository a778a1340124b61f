"""The stage-ranges feature's planning pass: with ``FUSIBLE_STAGE_RANGES=1`` in the
environment when a plan is made, each eager stage runs inside a profiler range named after
it (``runtime/features/stage_ranges.py``), so ``torch.profiler`` traces (and NVTX under
``torch.autograd.profiler.emit_nvtx``) show which stage ran which kernels. Compiled stages
need none: each is a custom op named after its stage already."""

from __future__ import annotations

import os
from typing import Optional

import attrs

from fusible.planning.exec_plan import Preparation

ENVIRONMENT = "FUSIBLE_STAGE_RANGES"


@attrs.frozen
class StageRanges:
    """The range name of each stage: ``((lo, name), ...)`` per lane."""

    forward: tuple
    backward: tuple


def attach(prep: Preparation, attached: dict) -> Optional[StageRanges]:
    if os.environ.get(ENVIRONMENT, "0") in ("", "0"):
        return None
    return StageRanges(tuple((st.lo, f"fusible {st.provenance}") for st in prep.forward),
                       tuple((st.lo, f"fusible {st.provenance} (backward)")
                             for st in prep.backward))
