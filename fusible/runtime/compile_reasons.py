"""Why a planned stage cannot run compiled, recorded once per plan in its public stages
(``Stage.compile_reason``): the plan and its diagram show it, and the compiled path
refuses such a plan with that reason."""

from __future__ import annotations

import attrs

from fusible.planning.exec_plan import ExecPlan
from fusible.runtime import custom_ops


def compile_reason(stage) -> "str | None":
    """Why a planned stage cannot run compiled (its own reason, or its args cannot become a
    custom-op schema: not asked of a stage traced inline, which has no custom op), or None."""
    direction = stage.direction
    own = stage.op.compile_unsupported_reason(direction)
    if own is not None or stage.inline_when_compiled:
        return own
    return custom_ops.unsupported_reason(stage.op.__class__, direction)


def with_compile_reasons(plan: ExecPlan) -> ExecPlan:
    """``plan`` with each public stage's ``compile_reason`` filled in."""
    def mark(stage):
        reason = compile_reason(stage)
        return stage if reason is None else attrs.evolve(stage, compile_reason=reason)

    group = attrs.evolve(plan.group, forward=tuple(map(mark, plan.group.forward)),
                         backward=tuple(map(mark, plan.group.backward)))
    return attrs.evolve(plan, group=group, backward_stages=tuple(map(mark, plan.backward_stages)))
