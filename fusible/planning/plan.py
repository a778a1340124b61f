"""FusionPlan: what the planner decided for a whole Sequential, to read and to draw."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from fusible.core.conditions import PlanConditions
from fusible.core.hooks import has_hooks
from fusible.core.operation import FusibleSpec

from fusible.planning.passes import op_communication
from fusible.planning.planner import Stage
from fusible.planning.viz import plan_to_dot, render_dot
from fusible.quantization.gemm_policy import gemm_decision


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
    conditions : PlanConditions
        The conditions the plan was made for (``device_type``, ``dtype``,
        ``grad_enabled`` and ``recipe`` are shortcuts).
    wgrad : tuple of Stage
        Under :func:`fusible.split_backward`, the deferred weight-gradient lane: one
        stage (direction ``"wgrad"``) per backward stage that split, in the order their
        dgrad stages run (``backward`` is then the dgrad lane); empty otherwise.
    wgrad_kept : tuple of (Stage, str)
        Under :func:`fusible.split_backward`, the backward stages whose parameter
        gradients stay with their dgrad, and why.
    left_out : tuple
        Ops of the pipeline that return their input unchanged as configured
        (``Dropout(p=0)``), left out of ``ops`` so that fusions match across them.
    """

    forward: tuple
    backward: tuple
    candidates: tuple
    ops: tuple = attrs.field(repr=False)
    conditions: PlanConditions
    recipe: Any = None
    op_needs: dict = attrs.field(factory=dict, repr=False, eq=False)  # op index -> OpGradNeeds
    wgrad: tuple = ()
    wgrad_kept: tuple = ()
    left_out: tuple = attrs.field(default=(), repr=False, eq=False)
    op_recipes: dict = attrs.field(factory=dict, repr=False, eq=False)  # op index -> recipe

    @property
    def device_type(self) -> str:
        return self.conditions.device_type

    @property
    def dtype(self) -> torch.dtype:
        return self.conditions.dtype

    @property
    def grad_enabled(self) -> bool:
        return self.conditions.grad_enabled

    def explain(self) -> str:
        """A readable account of the stages and of every fusion that matched."""
        lines = [f"FusionPlan: {len(self.ops)} ops on {self.device_type}, {self.dtype}, "
                 f"grad {'enabled' if self.grad_enabled else 'disabled'}"
                 + (f", recipe {self.recipe}" if self.recipe is not None else "")
                 + self.emulation_note()]
        split = self.conditions.split_backward and self.grad_enabled
        lanes = [("forward", self.forward, "forward"),
                 ("backward: dgrad lane" if split else "backward", self.backward, "backward")]
        for title, stages, direction in lanes:
            lines.append(f"{title} ({len(stages)} stages, in execution order):")
            for s in stages:
                lines.append(f"  {_indices(s.indices):<10} {s.name:<30} {_compile_note(s):<10} "
                             f"{self._covered(s)}")
                comm = self.communication(s, direction)
                if comm:
                    lines.append(f"  {'':<10} communicates: {'; '.join(comm)}")
            if not stages:
                lines.append("  (none: no gradient is needed)")
        if split:
            lines += self._wgrad_lines()
        if self.left_out:
            lines.append("left out (they return their input): "
                         + ", ".join(op.describe() for op in self.left_out))
        lines.append("fusions that matched:")
        for c in self.candidates:
            why = f": {c.reason}" if c.reason else ""
            lines.append(f"  {c.direction:<8} {c.fusion:<30} {_indices(c.indices):<10} "
                         f"{c.status}{why}")
        if not self.candidates:
            lines.append("  (none)")
        return "\n".join(lines)

    def _wgrad_lines(self) -> list:
        """The wgrad lane and the stages kept whole, for :meth:`explain`."""
        lines = [f"wgrad lane ({len(self.wgrad)} stages, deferred: each runs when the "
                 f"deferred wgrads are, in any order after its dgrad):"]
        for s in self.wgrad:
            lines.append(f"  {_indices(s.indices):<10} {s.name:<30} {_compile_note(s):<10} "
                         f"{self._covered(s)}")
        if not self.wgrad:
            lines.append("  (none: no stage splits)")
        for s, why in self.wgrad_kept:
            lines.append(f"  {_indices(s.indices):<10} {s.name}: wgrad with its dgrad: {why}")
        return lines

    def emulation_note(self) -> str:
        """``", FP8 GEMMs emulated (...)"`` naming the recipe's scalings that have no
        native GEMM on this plan's device, or ``""``."""
        if self.recipe is None:
            return ""
        emulated = self.recipe.emulated_scalings(torch.device(self.device_type))
        return f", FP8 GEMMs emulated ({', '.join(emulated)})" if emulated else ""

    def communication(self, stage: Stage, direction: str) -> list:
        """``["Op: what (where)", ...]``: the collectives a stage runs."""
        out = []
        for i in stage.indices:
            op = self.ops[i]
            for where, what in op_communication(op, direction, self.op_needs.get(i)):
                out.append(f"{op.__class__.__name__}: {what}" + ("" if where == "is" else
                                                           f" ({where} its compute)"))
        return out

    def _covered(self, stage: Stage) -> str:
        return " + ".join(describe_op(self.ops[i], self.conditions)
                          + (f" [{self.gemm_note(i)}]" if self.gemm_note(i) else "")
                          for i in stage.indices)

    def runs_fp8(self, index: int) -> bool:
        """Whether op ``index`` computes under the plan's recipe (a GEMM the FP8 policy
        keeps in high precision does not)."""
        return self.recipe is not None and self.op_recipes.get(index, self.recipe) is not None

    def gemm_note(self, index: int) -> str:
        """For a GEMM op under a recipe: ``"FP8"``, or why it stays in high precision
        (:mod:`fusible.quantization.gemm_policy`); else ``""``."""
        op = self.ops[index]
        if self.recipe is None or getattr(op, "fp8_gemm_shape", None) is None:
            return ""
        if self.runs_fp8(index):
            return "FP8"
        why = gemm_decision(self.recipe, op, self.device_type)
        return "high precision" + (f": {why}" if why else "")

    def to_dot(self) -> str:
        """Graphviz DOT source of the plan diagram (no graphviz binary needed)."""
        return plan_to_dot(self)

    def render(self, path: str, format: str = "svg",
               dot_source_without_graphviz: bool = False) -> str:
        """Write the plan diagram to ``path`` (extension added) and return the file's path.

        Parameters
        ----------
        path : str
            Output path without extension, e.g. ``"mlp_plan"``.
        format : {"svg", "png", "pdf"}
            Image format; needs the graphviz ``dot`` binary.
        dot_source_without_graphviz : bool
            Without the graphviz ``dot`` binary, write the DOT source to ``path.dot`` (and
            return that path) instead of raising.
        """
        return render_dot(self.to_dot(), path, format, dot_source_without_graphviz)


def _compile_note(stage) -> str:
    if stage.is_module:
        hooked = isinstance(stage.op, FusibleSpec) or has_hooks(stage.op)
        return "(hooks: own call)" if hooked else "(module)"
    reason = stage.compile_reason
    if reason is not None:
        return f"EAGER ONLY ({reason})"
    return "compiles inline" if stage.inline_when_compiled else "compiles"


def _indices(indices) -> str:
    return "[" + ", ".join(str(i) for i in indices) + "]"


def describe_op(op, conditions=None) -> str:
    """An op's ``describe()`` (and its :meth:`plan_note` for ``conditions``), or an
    ordinary module's class name."""
    describe = getattr(op, "describe", None)
    if describe is None:
        return op.__class__.__name__
    note = getattr(op, "plan_note", None)
    note = note(conditions) if note is not None and conditions is not None else ""
    return describe() + (f" [{note}]" if note else "")
