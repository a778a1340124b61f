"""Gated MLPs merged into one fusible block: ``down(silu(gate(x)) * up(x))`` becomes
``ops.Sequential(gate_up=BasicLinear, act=SwiGLU, down=BasicLinear)``, one GEMM for both
projections, its checkpoints still under the original names (``convert(model,
merge_gated_mlps=True)``, :mod:`fusible.models.conversion`)."""

from __future__ import annotations

import collections
from typing import Optional, cast

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

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


# The parameters a merge replaced, by their name in the model: an optimizer built before
# the merge holds them and not the merged one, so they would silently stop training.
# (keyed by identity: a tensor's == is elementwise)
_REPLACED = WeakIdKeyDictionary()
_HOOK: list = []


def merged_gated_mlp(module, names: tuple, path: str = "") -> Sequential:
    """``ops.Sequential(gate_up, act, down)`` computing ``module`` (at ``path`` in its
    model), whose state dict keeps ``module``'s names. The gate and up weights it replaces
    are refused by every optimizer step from now on (:func:`_refuse_replaced`)."""
    gate_name, up_name, down_name = names
    gate, up, down = (getattr(module, n) for n in names)
    for name, layer in ((gate_name, gate), (up_name, up)):
        _REPLACED[layer.weight] = f"{path}.{name}.weight" if path else f"{name}.weight"
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_replaced))
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


def _refuse_replaced(optimizer, args, kwargs) -> None:
    """An optimizer step over a parameter a merge replaced: it trains nothing the model
    computes with, and the merged parameter, which does, gets no step."""
    if not _REPLACED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _REPLACED.get(p)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): it holds {name}, which "
                    f"fusible.convert(..., merge_gated_mlps=True) replaced by the merged "
                    f"gate/up parameter of a fused SwiGLU block; that parameter is not in "
                    f"this optimizer, so the model's gate and up projections would not train. "
                    f"Build the optimizer after convert (model.parameters() then holds the "
                    f"merged one)")
