"""The execution features' runtime modules, and their hooks bound into a plan.

Each field of :class:`fusible.planning.features.Features` has a runtime module of the
same name here (found by that name when this package loads: a new feature adds no line
here), whose ``FEATURE`` is a :class:`~fusible.runtime.features.base.RuntimeFeature`.
:func:`bind` gives a plan the overridden hooks of the features it uses, each bound to
the feature's record, so the runner and the executor call exactly those.
"""

from __future__ import annotations

import functools
import importlib

import attrs

from fusible.planning.exec_plan import ExecPlan
from fusible.planning.features import Features
from fusible.runtime.features.base import NODE_HOOKS, RuntimeFeature, StageHooks, overrides


def _load() -> dict:
    """``{field name: its RuntimeFeature}``, one module per field of Features."""
    found = {}
    for field in attrs.fields(Features):
        feature = importlib.import_module(f"{__name__}.{field.name}").FEATURE
        if not isinstance(feature, RuntimeFeature) or feature.name != field.name:
            raise TypeError(f"{__name__}.{field.name}.FEATURE must be the RuntimeFeature "
                            f"named {field.name!r}, got {feature!r}")
        found[field.name] = feature
    return found


RUNTIME = _load()
# The guards of the features some plan has used so far: every eager call runs them (none
# until a plan uses a feature with a guard, so that unused features cost nothing).
GUARDS: list = []


@attrs.frozen
class Hooks:
    """A plan's bound feature hooks.

    Attributes
    ----------
    begin_forward, end_forward, forward_node, begin_backward, end_backward : tuple
        Callables of the node-level hooks (their record bound), in pass order.
    forward, backward : tuple
        Per stage of the lane, its :class:`StageHooks` (None: the stage has none).
    tensors : tuple
        ``(name, RuntimeFeature, record, count)`` of the features whose tensors the
        plan's node takes, in the order they are passed.
    uses_store : bool
        Whether some feature keeps something in a pass's ``call.store``.
    active : bool
        Whether any hook is bound (else the executor runs the plan without a ``Call``).
    """

    begin_forward: tuple = ()
    end_forward: tuple = ()
    forward_node: tuple = ()
    begin_backward: tuple = ()
    end_backward: tuple = ()
    forward: tuple = ()
    backward: tuple = ()
    tensors: tuple = ()
    uses_store: bool = False
    active: bool = attrs.field(init=False)

    def __attrs_post_init__(self):
        bound = (self.begin_forward, self.end_forward, self.forward_node, self.begin_backward,
                 self.end_backward, self.tensors)
        object.__setattr__(self, "active", any(bound) or any(h is not None for h in
                                                             self.forward + self.backward))

    @property
    def tensor_features(self) -> tuple:
        """The names of the features whose tensors the node takes, in order."""
        return tuple(name for name, *_ in self.tensors)


def bind(plan: ExecPlan) -> ExecPlan:
    """``plan`` with the hooks of its features, after each feature's ``planned``."""
    for name, record in plan.features.active():
        feature = RUNTIME[name]
        plan = feature.planned(record, plan)
        if feature.guard is not None and feature.guard not in GUARDS:
            GUARDS.append(feature.guard)
    # the records as planned left them
    active = [(RUNTIME[name], record) for name, record in plan.features.active()]
    node = {hook: tuple(functools.partial(getattr(f, hook), r) for f, r in active
                        if overrides(f, hook)) for hook in NODE_HOOKS}
    tensors = tuple((f.name, f, r, f.count(r)) for f, r in active if f.count(r))
    return attrs.evolve(plan, hooks=Hooks(
        **node, forward=tuple(_stage(active, st, "forward") for st in plan.forward),
        backward=tuple(_stage(active, st, "backward") for st in plan.backward),
        tensors=tensors, uses_store=any(f.uses_store for f, _ in active)))


def _stage(active: list, st, direction: str):
    """The features' hooks around ``st`` merged (None where none has any)."""
    found = [h for f, r in active for h in (f.stage_hooks(r, st, direction),) if h is not None]
    if not found:
        return None
    computes = [h.compute for h in found if h.compute is not None]
    if len(computes) > 1:
        raise RuntimeError(f"two execution features replace the compute of the {direction} "
                           f"stage {st.provenance}; at most one may")
    return StageHooks(tuple(b for h in found for b in h.before),
                      computes[0] if computes else None,
                      tuple(a for h in found for a in h.after))
