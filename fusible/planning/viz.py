"""FusionPlan -> graphviz: basic ops as nodes, stages as clusters, two lanes (three
with a split backward).

The forward lane runs left to right above the backward lane, whose arrows point
back, right to left, the way gradients flow. Each op sits in the same column in
every lane. Fused stages are coloured clusters named after the fusion; refused
fusions hang below their lane as notes with the reason. Under a split backward the
backward lane is the dgrad lane, and the deferred wgrad stages form a third lane
below it, each hanging from its dgrad stage by a dashed arrow.
"""

from __future__ import annotations

import os
import shutil
import textwrap

from fusible.planning.passes import op_communication

_LANES = {
    "forward": {"fused": "#cfe2ff", "edge": "#1f4e9c", "refused": "#b02a37"},
    "backward": {"fused": "#ffe5c2", "edge": "#a35200", "refused": "#b02a37"},
    "wgrad": {"fused": "#e4d7f5", "edge": "#5b2a86", "refused": "#b02a37"},
}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _op_label(op, conditions, gemm_note: str = "") -> str:
    label = getattr(op, "diagram_label", None)
    if label is not None:
        name = op.__class__.__name__  # a lone op's proxy reports its op's class
        lines = [name, label(), op.plan_note(conditions) if hasattr(op, "plan_note") else "",
                 gemm_note]
        return "\n".join(line for line in lines if line)
    return f"{op.__class__.__name__}\n(torch module)"


def _node(lane: str, index: int) -> str:
    return f"{lane[0]}{index}"


def plan_to_dot(plan) -> str:
    """Graphviz DOT source for ``plan``."""
    title = (f"FusionPlan  |  {plan.device_type}, {str(plan.dtype).replace('torch.', '')}, "
             f"grad {'enabled' if plan.grad_enabled else 'disabled'}"
             + (f", {plan.recipe.name} FP8" if plan.recipe is not None else "")
             + plan.emulation_note())
    lines = ["digraph FusionPlan {",
             "  rankdir=LR; newrank=true; nodesep=0.35; ranksep=0.45;",
             f"  label={_quote(title)}; labelloc=t; fontname=Helvetica; fontsize=16;",
             '  node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica, '
             'fontsize=11];',
             "  edge [fontname=Helvetica, fontsize=10];"]
    # In a left-to-right layout graphviz stacks lanes in reverse order of definition:
    # define the wgrad lane, then the backward lane, so that the forward lane sits on top.
    for lane, stages in (("wgrad", plan.wgrad), ("backward", plan.backward),
                         ("forward", plan.forward)):
        if stages:
            lines += _lane(plan, lane, stages)
    for i in sorted(i for stage in plan.backward for i in stage.indices):
        lines.append(f"  {{rank=same; {_node('forward', i)}; {_node('backward', i)};}}")
    for stage in plan.wgrad:
        for i in stage.indices:
            lines.append(f"  {{rank=same; {_node('backward', i)}; {_node('wgrad', i)};}}")
        i = stage.indices[0]
        lines.append(f'  {_node("backward", i)} -> {_node("wgrad", i)} [style=dashed, '
                     f'color="{_LANES["wgrad"]["edge"]}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _lane(plan, lane: str, stages) -> list:
    colors = _LANES[lane]
    order = {"forward": "execution order", "backward": "execution order: right to left",
             "wgrad": "deferred: any order after its dgrad"}[lane]
    if lane == "backward" and plan.wgrad:
        lane_title = "backward: dgrad lane"
    else:
        lane_title = {"wgrad": "wgrad lane"}.get(lane, lane)
    out = [f"  subgraph cluster_{lane} {{",
           f"    label={_quote(f'{lane_title} ({len(stages)} stages, {order})')}; labeljust=l;",
           '    style="rounded,dashed"; color="#888888"; fontsize=13;']
    for k, stage in enumerate(sorted(stages, key=lambda s: s.indices[0])):
        out += _stage_cluster(plan, lane, k, stage, colors)
    ids = [_node(lane, i) for i in sorted(i for stage in stages for i in stage.indices)]
    for a, b in zip(ids, ids[1:]) if lane != "wgrad" else ():  # wgrads: no flow between
        direction = ", dir=back" if lane == "backward" else ""
        out.append(f'    {a} -> {b} [color="{colors["edge"]}"{direction}];')
    out += _refusals(plan, lane, colors)
    out.append("  }")
    return out


def _stage_cluster(plan, lane, k, stage, colors) -> list:
    reason = stage.compile_reason
    if reason is not None:  # a stage that cannot be compiled: say so where it stands
        label = stage.name + "\nnot compilable: " + "\n".join(textwrap.wrap(reason, 44))
        style = (f'style="rounded,dashed,filled"; fillcolor="#fff5f5"; color="{colors["refused"]}"; '
                 f'penwidth=2; fontcolor="{colors["refused"]}"; label={_quote(label)}; fontsize=10;')
    elif stage.fused:
        joint = " (joint: both passes)" if stage.op.direction == "both" else ""
        style = (f'style="rounded,filled"; fillcolor="{colors["fused"]}"; color="{colors["edge"]}"; '
                 f'label={_quote(stage.name + joint)}; fontsize=12;')
    else:
        style = 'style=invis; label="";'
    out = [f"    subgraph cluster_{lane}_{k} {{", f"      {style}"]
    for i in stage.indices:
        op = plan.ops[i]
        comm = op_communication(op, lane, plan.op_needs.get(i))
        shape = ', shape=box3d, style=filled, fillcolor="#eeeeee"' if stage.is_module else ""
        if any(where == "is" for where, _ in comm):
            shape = f', shape=cds, style=filled, fillcolor="{_COMM}"'
        label = _quote(_op_label(op, plan.conditions, plan.gemm_note(i)))
        out.append(f"      {_node(lane, i)} [label={label}{shape}];")
        out += _comm_nodes(lane, i, comm)
    out.append("    }")
    return out


_COMM = "#d7f5dd"


def _comm_nodes(lane: str, i: int, comm) -> list:
    """An op's own collectives as nodes stacked with it; dotted arrows follow the data
    (into the op for a collective before its compute, out of it for one after)."""
    out = []
    for k, (where, what) in enumerate(c for c in comm if c[0] != "is"):
        node, op = f"{_node(lane, i)}c{k}", _node(lane, i)
        out.append(f'      {node} [label={_quote(what)}, shape=cds, style=filled, '
                   f'fillcolor="{_COMM}", fontsize=9];')
        a, b = (node, op) if where == "before" else (op, node)
        out.append(f'      {a} -> {b} [style=dotted];')
        out.append(f"      {{rank=same; {op}; {node};}}")
    return out


def _refusals(plan, lane, colors) -> list:
    out = []
    refused = [c for c in plan.candidates if c.direction == lane and c.status == "refused"]
    for k, cand in enumerate(refused):
        note = f"{lane[0]}refused{k}"
        reason = "\n".join(textwrap.wrap(cand.reason, 44))
        text = f"{cand.fusion} refused\n{reason}"
        out.append(f'    {note} [shape=note, style="filled,dashed", fillcolor="#fff5f5", '
                   f'color="{colors["refused"]}", fontcolor="{colors["refused"]}", '
                   f'fontsize=9, label={_quote(text)}];')
        middle = cand.indices[len(cand.indices) // 2]
        out.append(f"    {{rank=same; {_node(lane, middle)}; {note};}}")
        for i in sorted({cand.indices[0], cand.indices[-1]}):
            out.append(f'    {_node(lane, i)} -> {note} [style=dashed, arrowhead=none, '
                       f'color="{colors["refused"]}", constraint=false];')
    return out


_FORMATS = ("svg", "png", "pdf")


def render_dot(source: str, path: str, format: str = "svg", dot_source_without_graphviz=False
               ) -> str:
    """Render DOT source to ``path.<format>`` with the graphviz binary; return the file path.
    Without the binary: an error, or with ``dot_source_without_graphviz`` the source written
    to ``path.dot`` (the path returned says which)."""
    if format not in _FORMATS:
        raise ValueError(f"render: format must be one of {_FORMATS}, got {format!r}")
    root, ext = os.path.splitext(path)
    if ext.lstrip(".") == format:
        path = root
    if shutil.which("dot") is None:
        if dot_source_without_graphviz:
            with open(f"{path}.dot", "w") as f:
                f.write(source)
            return f"{path}.dot"
        raise RuntimeError("render needs the graphviz 'dot' binary, which is not on PATH "
                           "(on Debian/Ubuntu: apt-get install -y graphviz); "
                           "plan.to_dot() works without it, and so does "
                           "render(..., dot_source_without_graphviz=True)")

    import graphviz  # here, not with the module: only rendering needs it

    return graphviz.Source(source).render(outfile=f"{path}.{format}", format=format,
                                          cleanup=True)
