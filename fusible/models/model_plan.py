"""The plan of a whole model: every fusible group it runs, with its module path.

:func:`plan_model` runs the model once on example inputs and records, in call order,
each outermost fusible module it calls (a Sequential or a lone op: its
:class:`~fusible.FusionPlan` for that call) and each ordinary leaf module between them.
:class:`ModelPlan` totals them, and its :meth:`~ModelPlan.explain` and diagram show
repeated blocks once (``layers.0-11``: the same relative paths and identical plans).
"""

from __future__ import annotations

import collections
import contextlib
import re
from typing import Any, Iterator, Optional, cast

import attrs
import torch
from torch import nn

from fusible.core.operation import FusibleSpec
from fusible.models.model_plan_dot import model_plan_dot
from fusible.module import Sequential, outermost_fusible
from fusible.planning.passes import op_communication
from fusible.models.decoder_layers import FusedLayerForward
from fusible.models.experts import FusedExpertsForward
from fusible.planning.plan import FusionPlan, describe_op
from fusible.planning.viz import render_dot


@attrs.frozen
class ModelItem:
    """One call the model made: a fusible group (``plan`` set) or an ordinary module."""

    path: str        # the module's name in ``model.named_modules()`` ("" for the model)
    kind: str        # the module's class name
    plan: Optional[FusionPlan] = None

    @property
    def fusible(self) -> bool:
        return self.plan is not None

    def label(self, in_block: bool = False) -> str:
        """The item's name where it is shown: its path, or what an empty path stands for
        (a repeated block that is itself one fusible group, or the model)."""
        return self.path or ("(the block)" if in_block else "(the model)")

    def fp8_ops(self) -> list:
        """``"Name[index]"`` of each op of the group that runs in FP8 under its recipe."""
        plan = self.plan
        if plan is None or plan.recipe is None:
            return []
        return [f"{type(op).__name__}[{k}]" for k, op in enumerate(plan.ops)
                if isinstance(op, FusibleSpec) and plan.runs_fp8(k)
                and cast(Any, op).quantizes(plan.recipe, "forward")]

    def signature(self) -> tuple:
        """What the item computes, for finding identical repeated blocks."""
        if self.plan is None:
            return (self.kind,)
        return (self.kind, _stages_key(self.plan.forward), _stages_key(self.plan.backward),
                tuple(describe_op(op) for op in self.plan.ops))


@attrs.frozen
class Block:
    """Consecutive items, or a run of repeated blocks ``prefix.first-last`` whose items
    have the same relative paths and signatures (``count`` > 1)."""

    prefix: str      # "layers" for layers.0-11; "" for items outside a repeated block
    first: int
    count: int
    items: tuple     # the first block's items (paths relative to ``prefix.first``)

    @property
    def label(self) -> str:
        if not self.prefix:
            return ""
        last = self.first + self.count - 1
        return f"{self.prefix}.{self.first}" + (f"-{last}" if self.count > 1 else "")


@attrs.frozen
class ModelPlan:
    """The plans of every fusible group a model ran, in call order.

    Attributes
    ----------
    items : tuple of ModelItem
        Fusible groups (with their plan) and ordinary leaf modules, in call order.
    blocks : tuple of Block
        The same items with repeated blocks collapsed.
    """

    items: tuple
    blocks: tuple

    @property
    def plans(self) -> list:
        """``(path, FusionPlan)`` of every fusible group, in call order."""
        return [(i.path, i.plan) for i in self.items if i.fusible]

    def totals(self) -> dict:
        """Counts over the whole model: groups, stages, fusions chosen and refused (by
        name), FP8 GEMMs, collectives, stages that cannot compile."""
        chosen: collections.Counter = collections.Counter()
        refused: collections.Counter = collections.Counter()
        out: dict[str, Any] = {"fusible groups": 0, "ordinary modules": 0, "forward stages": 0,
               "backward stages": 0, "wgrad stages": 0, "FP8 GEMMs": 0, "collectives": 0,
               "cannot compile": 0}
        for item in self.items:
            if not item.fusible:
                out["ordinary modules"] += 1
                continue
            plan = item.plan
            out["fusible groups"] += 1
            out["forward stages"] += len(plan.forward)
            out["backward stages"] += len(plan.backward)
            out["wgrad stages"] += len(plan.wgrad)
            out["cannot compile"] += sum(s.compile_reason is not None
                                         for s in plan.forward + plan.backward + plan.wgrad)
            out["FP8 GEMMs"] += len(item.fp8_ops())
            out["collectives"] += sum(len(op_communication(op, d)) for op in plan.ops
                                      for d in ("forward", "backward"))
            for c in plan.candidates:
                (chosen if c.status == "chosen" else refused)[c.fusion] += c.status != \
                    "superseded"
        out["fusions chosen"] = dict(sorted(chosen.items()))
        out["fusions refused"] = dict(sorted((k, v) for k, v in refused.items() if v))
        return out

    def explain(self) -> str:
        """The totals, then each block: a repeated block shown once, with its count."""
        totals = self.totals()
        counts = ", ".join(f"{v} {k}" for k, v in totals.items() if isinstance(v, int))
        lines = [f"ModelPlan: {counts}"]
        for key in ("fusions chosen", "fusions refused"):
            if totals[key]:
                lines.append(f"{key}: " + ", ".join(f"{n} x{k}" for n, k in
                                                   totals[key].items()))
        for block in self.blocks:
            indent = ""
            if block.prefix:
                same = ": identical plans, shown once" if block.count > 1 else ""
                lines.append(f"{block.label}{same}")
                indent = "  "
            for item in block.items:
                lines += _item_lines(item, indent, bool(block.prefix))
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz DOT source: top to bottom, a cluster per block labelled by its path
        (a repeated block once, with its count), a node per fusible group listing its
        forward and backward stages (fusions in bold)."""
        return model_plan_dot(self)

    def render(self, path: str, format: str = "svg",
               dot_source_without_graphviz: bool = False) -> str:
        """Write the diagram to ``path`` (extension added) and return the file's path:
        as :meth:`fusible.FusionPlan.render`."""
        return render_dot(self.to_dot(), path, format, dot_source_without_graphviz)


def plan_model(model: nn.Module, *example_inputs: Any, **example_kwargs: Any) -> ModelPlan:
    """Run ``model(*example_inputs, **example_kwargs)`` once and collect the plan of every
    fusible group it calls, under the grad mode, ``fusible.autocast`` state and
    ``fusible.split_backward`` state in effect.

    Parameters
    ----------
    model : nn.Module
        Any module; its outermost fusible modules (Sequentials, lone ops) are planned as
        they are called, its other leaf modules recorded between them.
    *example_inputs, **example_kwargs
        What the model is called with (their dtypes, devices and ``requires_grad`` shape
        the plans). No backward runs, and the model's buffers (BatchNorm's running
        statistics, FP8 amax histories) and the random generators are as they were.

    Returns
    -------
    ModelPlan
    """
    names = {id(m): name for name, m in model.named_modules()}
    items, handles = [], []

    def fusible_call(module, args):
        plan = cast(Any, module).plan(*args)
        items.append(ModelItem(names[id(module)], type(module).__name__, plan))

    # An ordinary module is recorded where nothing recorded ran inside it: a leaf, or a
    # module computing with its children's parameters (nn.MultiheadAttention's out_proj).
    started: list = []

    def ordinary_start(module, args):
        started.append(len(items))

    def ordinary_end(module, args, output):
        if started.pop() == len(items):
            items.append(ModelItem(names[id(module)], type(module).__name__))

    for hook in (fusible_call, ordinary_start, ordinary_end):
        setattr(hook, "_fusible_planning", True)  # fused layers do not count these hooks
    fused_layers = _fused_decoder_layers(model)
    names.update({id(fused): path for path, fused in fused_layers})
    try:
        for module in [*outermost_fusible(model), *(fused for _, fused in fused_layers)]:
            handles.append(module.register_forward_pre_hook(fusible_call))
        for module in _ordinary_modules(model):
            handles.append(module.register_forward_pre_hook(ordinary_start))
            handles.append(module.register_forward_hook(ordinary_end, always_call=True))
        with _state_kept(model):
            model(*example_inputs, **example_kwargs)
    finally:
        for h in handles:
            h.remove()
    if not any(i.fusible for i in items):
        raise ValueError(f"plan_model: {type(model).__name__} called no fusible module on "
                         f"these inputs")
    return ModelPlan(tuple(items), collapse(items))


def _fused_decoder_layers(model: nn.Module) -> list:
    """``(path, fusible module)`` of each decoder layer ``convert`` fused whole (its
    TransformerLayer: :mod:`fusible.models.decoder_layers`) and each expert bank it runs as
    grouped GEMMs (:mod:`fusible.models.experts`): their plans are those modules'."""
    return [(path, module.forward.fused) for path, module in model.named_modules()
            if isinstance(module.__dict__.get("forward"), (FusedLayerForward,
                                                             FusedExpertsForward))]


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Planning does not train: the model's buffers (BatchNorm's running statistics,
    delayed scaling's amax histories) and the random number generators are as they were
    after the run; buffers the run made (FP8 states at their first plan) are left at their
    initial zeros."""
    before = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in before:
                    b.copy_(before[name])
                elif name.rsplit(".", 1)[-1].startswith("fp8_state_"):
                    b.zero_()
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _is_fusible(module) -> bool:
    return isinstance(module, (Sequential, FusibleSpec))


def _ordinary_modules(model) -> list:
    """The modules below ``model`` that are not fusible nor inside a fusible one."""
    found = []

    def walk(m):
        if _is_fusible(m):
            return
        if m is not model:
            found.append(m)
        for child in m.children():
            walk(child)

    walk(model)
    return found


_INDEXED = re.compile(r"^(.*?)\.(\d+)(?:\.(.*))?$")


def collapse(items) -> tuple:
    """Group items by the repeated block they belong to (``prefix.N...``: the first
    numbered path component) and merge consecutive blocks ``prefix.N``, ``prefix.N+1``...
    whose items have the same relative paths and signatures."""
    groups: list[Any] = []  # [prefix, index, [items with relative paths]]
    for item in items:
        m = _INDEXED.match(item.path)
        prefix, index = (m.group(1), int(m.group(2))) if m else ("", -1)
        relative = (m.group(3) or "") if m else item.path
        if groups and groups[-1][0] == prefix and groups[-1][1] == index:
            groups[-1][2].append(attrs.evolve(item, path=relative))
        else:
            groups.append([prefix, index, [attrs.evolve(item, path=relative)]])
    blocks: list[Block] = []
    for prefix, index, its in groups:
        last = blocks[-1] if blocks else None
        if (last is not None and prefix and last.prefix == prefix
                and index == last.first + last.count and _same(last.items, its)):
            blocks[-1] = attrs.evolve(last, count=last.count + 1)
        else:
            blocks.append(Block(prefix, max(index, 0), 1, tuple(its)))
    return tuple(blocks)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.path == y.path and x.signature() == y.signature()
                                    for x, y in zip(a, b))


def _stages_key(stages) -> tuple:
    return tuple((s.name, s.indices) for s in stages)


def _item_lines(item, indent: str, in_block: bool) -> list:
    name = item.label(in_block)
    if not item.fusible:
        return [f"{indent}{name}: {item.kind} (not fusible)"]
    plan = item.plan
    lines = [f"{indent}{name}: {item.kind}, {len(plan.ops)} ops"]
    for title, stages in (("forward", plan.forward), ("backward", plan.backward),
                          ("wgrad", plan.wgrad)):
        if stages:
            lines.append(f"{indent}  {title}: " + ", ".join(_stage_text(s) for s in stages))
    if plan.recipe is not None:
        fp8 = item.fp8_ops()
        lines.append(f"{indent}  FP8 ({plan.recipe.name}): "
                     + (", ".join(fp8) if fp8 else "no op of this group runs in FP8"))
    return lines


def _stage_text(stage) -> str:
    note = " (eager only)" if stage.compile_reason is not None else ""
    return f"{stage.name}{list(stage.indices)}{note}"
