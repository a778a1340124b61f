"""What an execution feature's runtime module provides: :class:`RuntimeFeature`, whose
hooks the runner and the executor call where the plan holds the feature's record (the
executor's :class:`~fusible.runtime.executor.Call` is the pass they act on).

Every hook is a no-op here; a feature overrides those it needs, and only overridden hooks
are bound into a plan (:func:`fusible.runtime.features.bind`), so a plan without
features pays nothing for them. Each hook gets the feature's record first.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import attrs

from fusible.runtime.executor import Call


@attrs.frozen
class StageHooks:
    """A feature's hooks around one stage: ``before(call, st)`` before its args are
    packed, ``compute(call, st, args)`` in place of the executor's (at most one feature
    per stage) and ``after(call, st, result)`` before the executor files the result."""

    before: tuple = ()
    compute: Optional[Callable[..., Any]] = None
    after: tuple = ()


class RuntimeFeature:
    """How one execution feature runs (``runtime/features/<name>.py``'s ``FEATURE``).

    ``name`` is the :class:`~fusible.planning.features.Features` field holding its record;
    ``guard`` (optional) runs before every eager call of any group, plan or not, once a
    plan with the feature has been made (until then nothing of it can be pending);
    ``uses_store`` says that its hooks keep something in the pass's ``call.store`` (a pass
    of a plan whose features keep nothing there gets a read-only empty one).
    """

    name: str = ""
    guard: Optional[Callable[[Any], None]] = None
    uses_store = False  # whether its hooks keep something in the pass's ``call.store``

    def count(self, record) -> int:
        """How many feature tensors (buffers the stages read or write: graph inputs when
        compiled) the plan's autograd node takes for this feature."""
        return 0

    def call_tensors(self, record, plan, runner, x) -> list:
        """The feature tensors of an eager call of ``plan`` on ``x``, read from the ops
        (``runner.memory`` keeps what the feature remembers across calls)."""
        return []

    def graph_tensors(self, runner, ops, params) -> list:
        """The same, read in code dynamo traces (so that they become graph inputs)."""
        return []

    def planned(self, record, plan):
        """Once per new plan, when the runtime takes it; returns the plan (evolved)."""
        return plan

    def begin_forward(self, record, call: Call) -> None:
        """Before the first forward stage (``call.tensors[name]``: this feature's tensors)."""

    def end_forward(self, record, call: Call) -> None:
        """After the last forward stage."""

    def forward_node(self, record, fctx, extra_inputs: tuple, output) -> None:
        """In the autograd node's forward after the stages: ``fctx`` is its context,
        ``extra_inputs`` the caller's as given, ``output`` the group's output."""

    def begin_backward(self, record, call: Call) -> None:
        """Before the first backward stage."""

    def end_backward(self, record, call: Call) -> None:
        """After the last backward stage."""

    def stage_hooks(self, record, st, direction: str) -> Optional[StageHooks]:
        """The hooks around stage ``st`` of the ``direction`` lane, or None."""
        return None


NODE_HOOKS = ("begin_forward", "end_forward", "forward_node", "begin_backward",
              "end_backward")


def overrides(feature: RuntimeFeature, hook: str) -> bool:
    """Whether ``feature`` defines ``hook`` (else binding it would run a no-op)."""
    return getattr(type(feature), hook) is not getattr(RuntimeFeature, hook)
