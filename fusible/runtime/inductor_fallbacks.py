"""Inductor's lowerings of fusible's custom ops, made before Inductor lowers a graph.

Inductor lowers an op it has no lowering for through an implicit fallback, and torch
2.11 first formats the op's arguments for a log line whether it is logged or not: each
argument's IR as text. An argument fed by a long chain of fused IR (the residual stream
of a whole model) prints as that whole chain, for every fusible op of the graph: a
converted 6-layer Llama's compile spent minutes there on an H200 (torch 2.13 formats
lazily; vLLM patches the same line). Making the fallbacks first, with the layout
constraint the implicit path chooses (the op's tag, else Inductor's default), lowers
each op exactly as before and skips the formatting.

:func:`make_fallbacks` runs from the stage ops' fake kernels, which run while
AOTAutograd traces, after Inductor is imported and before it lowers; it does nothing
unless Inductor is loaded, and sweeps the ``fusible`` namespace again only when ops
were registered since.
"""

from __future__ import annotations

import sys

import torch

_SWEPT: list = [None, -1]  # (the lowering module, the registration count) last swept
registrations = [0]        # custom ops registered in the namespace (custom_ops counts)


def make_fallbacks() -> None:
    """Give every ``fusible::`` op without an Inductor lowering its fallback."""
    lowering = sys.modules.get("torch._inductor.lowering")
    if lowering is None or _SWEPT == [lowering, registrations[0]]:
        return
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("fusible::"):
            continue
        base, _, overload = name.removeprefix("fusible::").partition(".")
        op = getattr(getattr(torch.ops.fusible, base), overload or "default")
        if op not in lowering.lowerings:
            tag = torch._library.utils.get_layout_constraint_tag(op, with_default=True)
            lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))
    _SWEPT[:] = [lowering, registrations[0]]
