"""Inductor's lowerings of fusible's custom ops, made before Inductor lowers a graph.

Inductor lowers an op it has no lowering for through an implicit fallback, and torch
2.11 first formats the op's arguments for a log line whether it is logged or not: each
argument's IR as text. An argument fed by a long chain of fused IR (the residual stream
of a whole model) prints as that whole chain, for every fusible op of the graph: a
converted 6-layer Llama's compile spent minutes there on an H200 (torch 2.13 formats
lazily; vLLM patches the same line). Making an op's fallback first, with the layout
constraint the implicit path chooses (the op's tag, else Inductor's default), lowers it
exactly as before and skips the formatting.

Every fusible custom op's fake kernel calls :func:`ensure_fallback` with its op: fake
kernels run while AOTAutograd traces, after Inductor is imported (when it compiles) and
before it lowers. It does nothing unless Inductor is loaded, and nothing where Inductor
is told to make no implicit fallbacks (it raises for such ops then, as it would).
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def ensure_fallback(op: Any) -> None:
    """Make Inductor's fallback of ``op`` (an OpOverload) where Inductor is loaded and has
    none."""
    lowering = sys.modules.get("torch._inductor.lowering")
    if lowering is None or op in lowering.lowerings:
        return
    config = sys.modules.get("torch._inductor.config")
    if config is not None and not config.implicit_fallbacks:
        return
    tag = torch._library.utils.get_layout_constraint_tag(op, with_default=True)
    lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))
