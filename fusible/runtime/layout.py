"""The flattened pipeline of a Sequential (or of one op), split into groups, and its plan;
cached on the module that runs it, through the small interface the runtime declares for
such modules (:class:`PipelineHost`)."""

from __future__ import annotations

import weakref
from typing import Protocol

import attrs
from torch import nn

from fusible.core import epoch, tokens
from fusible.core.conditions import PlanConditions
from fusible.core.hooks import global_hooks_active
from fusible.core.operation import FusibleSpec
from fusible.core.results import OpGradNeeds
from fusible.planning.plan import FusionPlan
from fusible.planning.planner import Stage
from fusible.runtime.runner import PipelineRunner


@attrs.frozen
class Called:
    """A pipeline item that runs as its own module call: an ordinary module, or a fusible
    operation or Sequential with module hooks. ``extra_inputs`` / ``extra_outputs``: how
    many of the pipeline's extra inputs it takes and extra outputs it returns."""

    module: nn.Module
    extra_inputs: int = 0
    extra_outputs: int = 0


class Layout:
    """The flattened pipeline split into runs of basic ops (one runner each) and items that
    run as their own module call.

    Attributes
    ----------
    items : tuple
        The flattened pipeline; plan indices are positions in it.
    groups : list
        ``(runner, None)`` for a run of basic ops, ``(None, Called)`` for an item called
        on its own.
    single : PipelineRunner or None
        The only runner when the pipeline is one group of basic ops.
    global_hooks : bool
        Whether global module hooks were registered when it was built.
    lone : bool
        Whether it is a lone op's layout, whose only entry is a ``weakref.proxy`` of the op.
    left_out : tuple
        Ops of the pipeline left out of ``items`` and of plans
        (``BasicOperationSpec.left_out_of_plans``: they return their input unchanged).
    """

    def __init__(self, entries: list, global_hooks: bool = False, left_out: tuple = ()):
        self.epoch = epoch.current()
        self.left_out = left_out
        self.global_hooks = global_hooks
        self.lone = len(entries) == 1 and type(entries[0]) in weakref.ProxyTypes
        self.items = tuple(e.module if isinstance(e, Called) else e for e in entries)
        self.groups: list[tuple] = []  # (runner, None) or (None, Called)
        run: list = []
        for i, entry in enumerate(list(entries) + [None]):
            if isinstance(entry, FusibleSpec):
                run.append(entry)
                continue
            if run:
                runner = PipelineRunner(tuple(run), i - len(run))
                tokens.register(runner)
                self.groups.append((runner, None))
                run = []
            if entry is not None:
                self.groups.append((None, entry))
        self.runners = [r for r, _ in self.groups if r is not None]
        self.single = self.runners[0] if len(self.groups) == 1 and self.runners else None
        counts = [(r.num_extra_inputs, r.num_extra_outputs) if r is not None else
                  (c.extra_inputs, c.extra_outputs) for r, c in self.groups]
        self.num_extra_inputs = sum(n for n, _ in counts)
        self.num_extra_outputs = sum(n for _, n in counts)

    def params(self) -> list:
        """The parameters of every group of basic ops, in order."""
        return [p for r in self.runners for p in r.params.read()]

    def run_eager(self, x, extra_inputs: tuple, training: bool):
        """Run eagerly: ``(y, *extra_outputs)`` if there are extra outputs, else ``y``."""
        if self.single is not None:  # one group of fusible ops: the common, fast case
            output, extra_outputs = self.single.run(x, extra_inputs, training)
            return (output, *extra_outputs) if extra_outputs else output
        return self.run(x, extra_inputs, lambda r, y, e: r.run(y, e, training))

    def run(self, x, extra_inputs: tuple, run_group):
        """Run the groups in order; ``run_group(runner, x, extras)`` returns ``(y, extra_outputs)``.

        Ordinary modules are called as they are.
        """
        if len(extra_inputs) != self.num_extra_inputs:
            raise TypeError(f"Sequential expects {self.num_extra_inputs} extra input(s) for "
                            f"its AddExtraInput ops, got {len(extra_inputs)}")
        extra_outputs, pos = [], 0
        for runner, called in self.groups:
            if runner is None:
                x, outs = _call(called, x, extra_inputs[pos:pos + called.extra_inputs])
                pos += called.extra_inputs
            else:
                k = runner.num_extra_inputs
                x, outs = run_group(runner, x, extra_inputs[pos:pos + k])
                pos += k
            extra_outputs.extend(outs)
        return (x, *extra_outputs) if self.num_extra_outputs else x

    def group_plans(self, conditions: PlanConditions, recipe) -> list:
        """Per group, in order, ``(index of its first item, Called or None, ExecPlan or
        None, upstream)``: the plan of a run of basic ops for the pipeline's
        ``conditions`` (``recipe``: the FP8 recipe they name), or the item called on its
        own; ``upstream``: whether anything up to the group's end requires grad."""
        c, found = conditions, []
        upstream, p_pos, e_pos = c.input_requires_grad, 0, 0
        for index, (runner, called) in self._positions():
            if runner is None:
                upstream = upstream or (c.grad_enabled and any(
                    p.requires_grad for p in called.module.parameters()))
                found.append((index, called, None, upstream))
                continue
            n, k = runner.num_params, runner.num_extra_inputs
            plan = runner.lookup(c._replace(
                input_requires_grad=upstream,
                params_requires_grad=c.params_requires_grad[p_pos:p_pos + n],
                extras_requires_grad=c.extras_requires_grad[e_pos:e_pos + k]), recipe)
            p_pos, e_pos = p_pos + n, e_pos + k
            upstream = upstream or plan.needs_backward
            found.append((index, None, plan, upstream))
        return found

    def plan(self, conditions: PlanConditions, recipe) -> FusionPlan:
        """The :class:`FusionPlan` of every group for the pipeline's ``conditions``
        (``recipe``: the FP8 recipe they name, or None)."""
        forward, backward_groups, candidates = [], [], []
        needs: dict[int, OpGradNeeds] = {}  # pipeline index -> its op's
        op_recipes: dict = {}  # pipeline index -> the recipe its op computes under
        wgrad_groups, kept = [], []
        for index, called, plan, upstream in self.group_plans(conditions, recipe):
            if plan is None:
                name, module = type(called.module).__name__, called.module
                forward.append(Stage(name, (index,), module, called_alone=True))
                if upstream:
                    backward_groups.append((Stage(name, (index,), module, "backward",
                                                  called_alone=True),))
                continue
            needs.update((index + i, op_needs) for i, op_needs in enumerate(plan.needs))
            op_recipes.update((index + i, r) for i, r in enumerate(plan.recipes()))
            forward += plan.group.forward
            backward_groups.append(plan.backward_stages)  # the stages that run
            split = plan.features.split_backward
            if split is not None:
                wgrad_groups.append(split.lane)
                kept += split.kept
            candidates += plan.group.candidates
        backward = tuple(s for group in reversed(backward_groups) for s in group)
        wgrad = tuple(s for group in reversed(wgrad_groups) for s in group)
        return FusionPlan(tuple(forward), backward, tuple(candidates), self.items, conditions,
                          recipe, needs, wgrad, tuple(kept), self.left_out, op_recipes)

    def _positions(self):
        """Yield (index of the group's first item, (runner, Called)) for each group."""
        index = 0
        for runner, called in self.groups:
            yield index, (runner, called)
            index += 1 if runner is None else len(runner.ops)


def _call(called: Called, x, extra_inputs: tuple):
    """Call an item on its own: ``(y, extra outputs)``."""
    out = called.module(x, *extra_inputs)
    if not called.extra_outputs:
        return out, ()
    return out[0], tuple(out[1:])


class PipelineHost(Protocol):
    """What the runtime needs of a module that runs as a fusible pipeline (``fusible.module``'s
    PipelineModule): its training mode, and the entries of its layout."""

    training: bool

    def layout_entries(self, global_hooks: bool) -> tuple:
        """``(entries, left out)``: basic ops and :class:`Called` items in pipeline order,
        and the ops left out of plans; ``global_hooks``: whether global module hooks are
        registered (then every op runs as its own call)."""
        ...


_CACHE = "_fusible_layout"  # the runtime's slot in a host's __dict__


def layout_of(host: PipelineHost) -> Layout:
    """The host's cached :class:`Layout`, rebuilt when the epoch moved on (or global module
    hooks came or went)."""
    cache = host.__dict__.get(_CACHE)
    hooks = global_hooks_active()
    if cache is None or cache.epoch != epoch.current() or cache.global_hooks != hooks:
        entries, left_out = host.layout_entries(hooks)
        cache = Layout(entries, hooks, left_out)
        object.__setattr__(host, _CACHE, cache)
    return cache


def built_layout(host: PipelineHost) -> Layout:
    """The layout :func:`layout_of` built last (read in code dynamo traces, after the
    compiled path made it eagerly)."""
    return getattr(host, _CACHE)


def without_layout(state: dict) -> dict:
    """A host's pickled state without its layout (rebuilt after loading)."""
    state.pop(_CACHE, None)
    return state
