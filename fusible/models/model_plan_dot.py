"""The diagram of a whole model's plan (:meth:`fusible.ModelPlan.to_dot`): top to bottom, a
cluster per block labelled by its path (a repeated block once, with its count), a node per
fusible group listing its forward and backward stages."""

from __future__ import annotations


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\l") + '\\l"'


def model_plan_dot(plan) -> str:
    """Graphviz DOT source of a :class:`~fusible.ModelPlan` (what its ``to_dot`` returns)."""
    totals = plan.totals()
    title = (f"ModelPlan  |  {totals['fusible groups']} fusible groups, "
             f"{totals['ordinary modules']} ordinary modules, {totals['FP8 GEMMs']} FP8 GEMMs")
    lines = ["digraph ModelPlan {", "  rankdir=TB; nodesep=0.3; ranksep=0.25;",
             f'  label="{title}"; labelloc=t; fontname=Helvetica; fontsize=16;',
             '  node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica, '
             'fontsize=10];']
    previous = None
    for k, block in enumerate(plan.blocks):
        nodes = [f"n{k}_{j}" for j in range(len(block.items))]
        if block.prefix:
            label = block.label + (f"  (x{block.count}, identical plans)" if block.count > 1
                                   else "")
            lines += [f"  subgraph cluster_{k} {{", f'    label="{label}"; labeljust=l;',
                      '    style="rounded,filled"; fillcolor="#f4f6fa"; color="#888888";',
                      "    fontsize=12;"]
        for node, item in zip(nodes, block.items):
            lines.append(f"    {node} [label={_quote(_node_text(item, bool(block.prefix)))}"
                         + (', fillcolor="#cfe2ff"' if item.fusible else
                            ', fillcolor="#eeeeee", shape=box3d') + "];")
        if block.prefix:
            lines.append("  }")
        for node in nodes:
            if previous is not None:
                lines.append(f"  {previous} -> {node};")
            previous = node
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node_text(item, in_block: bool) -> str:
    name = item.label(in_block)
    if not item.fusible:
        return f"{name}: {item.kind}"
    plan = item.plan
    text = [f"{name}: {item.kind}"]
    for title, stages in (("fwd", plan.forward), ("bwd", plan.backward)):
        if stages:
            text.append(f"{title}: " + ", ".join(s.name for s in stages))
    if plan.recipe is not None:
        text.append(f"FP8: {', '.join(item.fp8_ops()) or 'none'}")
    return "\n".join(text)
