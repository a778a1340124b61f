"""FusionPlan: what the planner decided for a whole Sequential, to read and to draw."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from fusible.planner import Stage


@attrs.frozen
class FusionPlan:
    """The plan of a Sequential for given conditions.

    Attributes
    ----------
    forward : tuple of Stage
        Forward stages in execution order.
    backward : tuple of Stage
        Backward stages that run, in execution order: ops before the first thing
        that requires grad have none (empty when no gradient is needed).
    candidates : tuple of Candidate
        Every fusion that matched somewhere: chosen, superseded or refused.
    ops : tuple
        The flattened pipeline; stage indices are positions in it.
    device_type, dtype, grad_enabled, recipe
        The conditions the plan was made for.
    """

    forward: tuple
    backward: tuple
    candidates: tuple
    ops: tuple = attrs.field(repr=False)
    device_type: str
    dtype: torch.dtype
    grad_enabled: bool
    recipe: Any = None
    op_needs: dict = attrs.field(factory=dict, repr=False, eq=False)  # op index -> OpGradNeeds

    def explain(self) -> str:
        """A readable account of the stages and of every fusion that matched."""
        lines = [f"FusionPlan: {len(self.ops)} ops on {self.device_type}, {self.dtype}, "
                 f"grad {'enabled' if self.grad_enabled else 'disabled'}"
                 + (f", recipe {self.recipe}" if self.recipe is not None else "")]
        for title, stages in (("forward", self.forward), ("backward", self.backward)):
            lines.append(f"{title} ({len(stages)} stages, in execution order):")
            for s in stages:
                lines.append(f"  {_indices(s.indices):<10} {s.name:<30} {_compile_note(s):<10} "
                             f"{self._covered(s)}")
                comm = self.communication(s, title)
                if comm:
                    lines.append(f"  {'':<10} communicates: {'; '.join(comm)}")
            if not stages:
                lines.append("  (none: no gradient is needed)")
        lines.append("fusions that matched:")
        for c in self.candidates:
            why = f": {c.reason}" if c.reason else ""
            lines.append(f"  {c.direction:<8} {c.fusion:<30} {_indices(c.indices):<10} "
                         f"{c.status}{why}")
        if not self.candidates:
            lines.append("  (none)")
        return "\n".join(lines)

    def communication(self, stage: Stage, direction: str) -> list:
        """``["Op: what (where)", ...]``: the collectives a stage runs."""
        out = []
        for i in stage.indices:
            op = self.ops[i]
            for where, what in op_communication(op, direction, self.op_needs.get(i)):
                out.append(f"{type(op).__name__}: {what}" + ("" if where == "is" else
                                                           f" ({where} its compute)"))
        return out

    def _covered(self, stage: Stage) -> str:
        return " + ".join(_describe(self.ops[i]) for i in stage.indices)

    def to_dot(self) -> str:
        """Graphviz DOT source of the plan diagram (no graphviz binary needed)."""
        from fusible.viz import plan_to_dot

        return plan_to_dot(self)

    def render(self, path: str, format: str = "svg") -> str:
        """Write the plan diagram to ``path`` (extension added) and return the file's path.

        Parameters
        ----------
        path : str
            Output path without extension, e.g. ``"mlp_plan"``.
        format : {"svg", "png", "pdf"}
            Image format; needs the graphviz ``dot`` binary.
        """
        from fusible.viz import render_dot

        return render_dot(self.to_dot(), path, format)


def _compile_note(stage) -> str:
    if stage.is_module:
        return "(module)"
    reason = stage.compile_reason
    return "compiles" if reason is None else f"EAGER ONLY ({reason})"


def _indices(indices) -> str:
    return "[" + ", ".join(str(i) for i in indices) + "]"


def _describe(op) -> str:
    describe = getattr(op, "describe", None)
    return describe() if describe is not None else type(op).__name__


def build_plan(layout, dtype, device_type, grad: bool, input_rg: bool,
               extras_rg: tuple, recipe=None) -> FusionPlan:
    """Plan every group of a layout for inputs of this dtype, device type and requires_grad."""
    forward, backward_groups, candidates, needs = [], [], [], {}
    upstream, extra_pos = input_rg and grad, 0
    for index, (runner, module) in _positions(layout):
        if runner is None:
            forward.append(Stage(type(module).__name__, (index,), module))
            upstream = upstream or (grad and any(p.requires_grad for p in module.parameters()))
            if upstream:
                backward_groups.append((Stage(type(module).__name__, (index,), module,
                                              "backward"),))
            continue
        k = runner.num_extra_inputs
        plan = runner.lookup(dtype, device_type, grad, upstream,
                             tuple(p.requires_grad for p in runner.params()),
                             extras_rg[extra_pos:extra_pos + k], recipe)
        extra_pos += k
        needs.update((index + i, n) for i, n in enumerate(plan.needs))
        forward += plan.group.forward
        backward_groups.append(plan.backward_stages)  # the stages that run
        candidates += plan.group.candidates
        upstream = upstream or plan.needs_backward
    backward = tuple(s for group in reversed(backward_groups) for s in group)
    return FusionPlan(tuple(forward), backward, tuple(candidates), layout.items, device_type,
                      dtype, grad, recipe, needs)


def _positions(layout):
    """Yield (index of the group's first op, (runner, module)) for each group."""
    index = 0
    for runner, module in layout.groups:
        yield index, (runner, module)
        index += 1 if runner is None else len(runner.ops)


def plan_conditions(layout, example_inputs, parameters) -> tuple:
    """``(dtype, device_type, input requires grad, extra inputs require grad)`` of the
    example inputs, or assumed from the parameters when there are none."""
    if example_inputs:
        x, extras = example_inputs[0], example_inputs[1:]
        if len(extras) != layout.num_extra_inputs:
            raise TypeError(f"plan() got {len(extras)} extra input(s); the Sequential takes "
                            f"{layout.num_extra_inputs}")
        return x.dtype, x.device.type, x.requires_grad, tuple(e.requires_grad for e in extras)
    first = next(iter(parameters), None)
    dtype = first.dtype if first is not None else torch.get_default_dtype()
    device_type = first.device.type if first is not None else "cpu"
    return dtype, device_type, False, (False,) * layout.num_extra_inputs


def op_communication(op, direction: str, needs=None) -> tuple:
    """``(where, what)`` collectives of ``op`` in ``direction`` (for the gradients in
    ``needs``, when given): those of its compute, and the all-reduce of its parameter
    gradients (``grad_reduction``) after a backward stage. Ordinary modules: none."""
    if not hasattr(op, "communication"):
        return ()
    comm = tuple(op.communication(direction, needs))
    tp = getattr(op, "grad_reduction", lambda: None)()
    if direction == "backward" and tp is not None and (needs is None or any(needs.params)):
        grads = ", ".join("d" + name for name in op.param_names)
        comm += (("after", f"all-reduce {grads} /{tp.world_size}"),)
    return comm
