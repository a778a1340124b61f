"""The parallel-agreement feature's planning pass: a group whose ops communicate over
process groups records, per group, what every rank of it must agree on (each such op's
configuration, the input dtype, the FP8 recipe); its runtime module compares them across
the group once per plan (``runtime/features/parallel_agreement.py``), so that ranks
configured differently fail naming the op instead of mixing up their collectives."""

from __future__ import annotations

from typing import Optional

import attrs

from fusible.planning.exec_plan import Preparation


@attrs.frozen
class ParallelAgreement:
    """Per process group (by name): what its ranks must agree on, as
    ``((group name, world size, ((what, value), ...)), ...)``."""

    groups: tuple


def attach(prep: Preparation, attached: dict) -> Optional[ParallelAgreement]:
    conditions = prep.conditions
    common = (("the input's dtype", str(conditions.dtype)),
              ("the FP8 recipe", conditions.recipe_key or "none"),
              ("a split backward", conditions.split_backward))
    found: dict = {}
    for i, op in enumerate(prep.ops):
        parallel = getattr(op, "parallel", None)
        if parallel is None or not parallel.active:
            continue
        entries = found.setdefault((parallel.group_name, parallel.world_size), list(common))
        entries.append((f"op [{prep.start + i}] of the group", op.describe()))
    if not found:
        return None
    return ParallelAgreement(tuple((name, size, tuple(entries))
                                   for (name, size), entries in found.items()))
