"""Ranks agree on a plan's parallel configuration (``planning/features/
parallel_agreement.py``): once per plan, each process group's ranks exchange what the
plan's ops there are and compare it; the first difference is an error on every rank,
naming the op and both values (one small all-gather of strings per group, when the plan
is made)."""

from __future__ import annotations

import torch.distributed as dist

from fusible.functional import parallel
from fusible.functional.parallel import TensorParallel
from fusible.runtime.features.base import RuntimeFeature


class ParallelAgreementRuntime(RuntimeFeature):
    name = "parallel_agreement"

    def planned(self, record, plan):
        for group_name, world_size, entries in record.groups:
            group = parallel.group_of(TensorParallel(None, False, group_name, world_size))
            everyone: list = [None] * world_size
            dist.all_gather_object(everyone, entries, group=group)
            _compare(entries, everyone, dist.get_rank(group))
        return plan


FEATURE = ParallelAgreementRuntime()


def _compare(mine: tuple, everyone: list, rank: int) -> None:
    """Raise at the first entry where another rank's differs from ``mine``."""
    for other, theirs in enumerate(everyone):
        if other == rank or tuple(theirs) == mine:
            continue
        for k in range(max(len(mine), len(theirs))):
            what, here = mine[k] if k < len(mine) else ("an op of the group", "none")
            there = theirs[k][1] if k < len(theirs) else "none"
            if here != there:
                raise RuntimeError(
                    f"fusible: the ranks of a process group disagree on {what}: rank {rank} "
                    f"has {here}, rank {other} has {there}; every rank must build the "
                    f"same model (the same ops, sizes, parallel modes, dtype and recipe), or "
                    f"their collectives would pair up wrongly")
