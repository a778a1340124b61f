"""Gated MLPs merged into one fusible block: ``down(silu(gate(x)) * up(x))`` becomes
``ops.Sequential(gate_up=BasicLinear, act=SwiGLU, down=BasicLinear)``, one GEMM for both
projections, its checkpoints still under the original names (``convert(model,
merge_gated_mlps=True)``, :mod:`fusible.models.conversion`)."""

from __future__ import annotations

import collections
from typing import Optional, cast

import torch
from torch import nn

from fusible.models.checkpoint_names import CheckpointNames
from fusible.module import PipelineModule, Sequential
from fusible.ops.basic_linear import BasicLinear
from fusible.ops.swiglu import SwiGLU

_GATED = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def gated_mlp_names(module) -> Optional[tuple]:
    """``(gate, up, down)`` child names of a gated MLP: three bias-free ``nn.Linear``
    children under those names, and the module computes ``down(silu(gate(x)) * up(x))``
    on a probe input."""
    if isinstance(module, PipelineModule):
        return None
    children = dict(module.named_children())
    for names in _GATED:
        layers = [children.get(n) for n in names]
        linears = [cast(nn.Linear, m) for m in layers
                   if isinstance(m, nn.Linear) and m.bias is None]
        if len(linears) != 3 or set(children) - set(names) - {"act_fn", "act"}:
            continue
        gate, up, down = linears
        if gate.weight.shape != up.weight.shape or down.in_features != gate.out_features:
            continue
        with torch.no_grad():
            x = torch.randn(2, gate.in_features, dtype=gate.weight.dtype,
                            device=gate.weight.device, generator=torch.Generator(
                                gate.weight.device).manual_seed(0))
            try:
                got = module(x)
            except Exception:  # noqa: BLE001 - not a module of one tensor: not this pattern
                continue
            want = down(nn.functional.silu(gate(x)) * up(x))
        if isinstance(got, torch.Tensor) and torch.allclose(got, want, rtol=1e-3, atol=1e-5):
            return names
    return None


def merged_gated_mlp(module, names: tuple) -> Sequential:
    """``ops.Sequential(gate_up, act, down)`` computing ``module``, whose state dict keeps
    ``module``'s names."""
    gate_name, up_name, down_name = names
    gate, up, down = (getattr(module, n) for n in names)
    merged = BasicLinear(gate.in_features, 2 * gate.out_features, device="meta",
                         dtype=gate.weight.dtype)
    merged.weight = nn.Parameter(torch.cat([gate.weight.detach(), up.weight.detach()]),
                                 requires_grad=gate.weight.requires_grad)
    out_proj = BasicLinear(down.in_features, down.out_features, device="meta",
                           dtype=down.weight.dtype)
    out_proj.weight = cast(nn.Parameter, down.weight)  # the same object
    block = Sequential(collections.OrderedDict(  # type: ignore[arg-type]
        [("gate_up", merged), ("act", SwiGLU()), (down_name, out_proj)]))
    split = gate.out_features  # checkpoints: gate_up.weight saved as the two originals
    CheckpointNames((("gate_up.weight", (f"{gate_name}.weight", f"{up_name}.weight"),
                      (split, split)),)).install(block)
    return block
