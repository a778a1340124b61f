"""The layers of a fusible model paired with those of its ``torch.nn`` twin, in the order
they run, each tensor with its counterpart: what :mod:`fusible.models.state_dicts` moves
weights along, both ways."""

from __future__ import annotations

import collections
from typing import Any, Optional, cast

import attrs
import torch
from torch import nn

from fusible.core.operation import BasicOperationSpec, FusibleSpec
from fusible.module import Sequential, outermost_fusible
from fusible.ops.basic_linear import BasicLinear
from fusible.ops.bias import Bias
from fusible.ops.gelu import GELU
from fusible.ops.layer_norm import LayerNorm
from fusible.ops.relu import ReLU
from fusible.ops.rms_norm import RMSNorm
from fusible.ops.silu import SiLU

_ACTIVATIONS = {nn.GELU: GELU, nn.ReLU: ReLU, nn.SiLU: SiLU}
_PARAMETERISED = (nn.Linear, nn.LayerNorm, nn.RMSNorm)


@attrs.frozen
class TensorPair:
    """One fusible tensor and its torch counterpart, with their state-dict names."""

    target: torch.Tensor
    target_names: tuple
    source: torch.Tensor
    source_names: tuple
    op: Optional[nn.Module]  # the fusible op (its shard), None for an ordinary module


_LINEAR_KINDS = (BasicLinear, Bias, LayerNorm, RMSNorm)


def paired(model: nn.Module, torch_module: nn.Module, example_input: Any) -> list:
    """The :class:`TensorPair` of every tensor of ``model`` and its counterpart in
    ``torch_module``, the layers paired in the order they run (the rules:
    :func:`fusible.state_dict_from_torch`); a ValueError names the first mismatch."""
    sources = _torch_layers(torch_module, example_input)
    with_activations = any(type(s) in _ACTIVATIONS for s in sources)  # else F.* calls
    targets = _fusible_layers(model, example_input, with_activations)
    target_names, source_names = _tensor_names(model), _tensor_names(torch_module)
    pairs: list = []
    pos = 0
    for src in sources:
        for layer in _layers_of(src, targets[pos] if pos < len(targets) else None):
            if pos >= len(targets):
                raise ValueError(f"{src} has no counterpart: the fusible model has no more "
                                 f"ops to pair")
            pairs += [TensorPair(t, target_names[id(t)], source, source_names[id(source)], op)
                      for t, op, source in _pair(src, layer, targets[pos], pos)]
            pos += 1
    if pos != len(targets):
        raise ValueError(f"{_describe(targets[pos])} and later ops have no counterpart in "
                         f"{type(torch_module).__name__}")
    return pairs


def _layers_of(src: nn.Module, next_target) -> list:
    """What ``src`` pairs with, one entry per fusible layer: ``(parameter names, op type,
    settings)`` for each op it maps to, or None for a module paired by its tensors."""
    if isinstance(src, nn.Dropout) and src.p > 0:
        raise ValueError(f"{src} has no fusible counterpart with the same masks "
                         f"(ops.Dropout draws its own: results differ in training)")
    if _own_tensors(src) and (not _pairs_with_an_op(src) or (
            next_target is not None and not _is_op(next_target))):
        return [None]  # an ordinary module, or one the fusible model kept as it is
    return list(_pairs(src))


def _pair(src, layer, target, pos: int) -> list:
    """``(fusible tensor, op or None, torch tensor)`` of ``src`` paired with ``target``."""
    what = f"{src} does not pair with {_describe(target)} (op {pos} to pair in the fusible model)"
    if layer is None:  # the same tensors
        if _is_op(target) or _shapes(target) != _shapes(src):
            raise ValueError(f"{what}: a module holding {_shapes(src)} expected, it holds "
                             f"{_shapes(target)}")
        own = dict(_own_tensors(target))
        return [(own[n], None, t) for n, t in _own_tensors(src)]
    names, target_type, settings = layer
    if not isinstance(target, target_type) or _settings(target) != settings:
        raise ValueError(f"{what}: {target_type.__name__} with {settings} expected, it has "
                         f"{_settings(target)}")
    return [(p, target, getattr(src, n)) for n, p in zip(names, target.fusible_params())]


def _pairs_with_an_op(module: nn.Module) -> bool:
    return isinstance(module, _PARAMETERISED) or type(module) in _ACTIVATIONS


def _fusible_layers(model, example_input, with_activations: bool) -> list:
    """The fusible model's ops to pair, and its ordinary modules holding tensors, in the
    order they run."""
    kinds = _LINEAR_KINDS + (tuple(_ACTIVATIONS.values()) if with_activations else ())

    def expand(module) -> list:
        layers = []
        for item in cast(Any, module).pipeline():
            if isinstance(item, kinds):
                layers.append(item)
            elif _is_op(item) and list(item.fusible_params()):
                raise ValueError(f"state_dict_from_torch cannot fill {item.describe()}: no "
                                 f"torch.nn layer maps to it (supported: "
                                 f"{', '.join(k.__name__ for k in _LINEAR_KINDS)})")
            elif not _is_op(item):
                layers += [m for m in item.modules() if _own_tensors(m)]
        return layers

    if isinstance(model, (Sequential, FusibleSpec)):
        return expand(model)
    if example_input is None:
        raise ValueError(f"{type(model).__name__} is not a fusible Sequential: the order its "
                         f"layers run in is known only by running it; pass example_input")
    fusible = outermost_fusible(model)
    ordinary = [m for m in _outside(model, fusible) if _own_tensors(m)]
    order = _run_order(model, fusible + ordinary, example_input, "fusible model")
    return [layer for m in order for layer in (expand(m) if m in fusible else [m])]


def _torch_layers(module: nn.Module, example_input) -> list:
    """The torch model's leaf modules and modules holding tensors, in the order they run."""
    layers = [m for m in module.modules() if not list(m.children()) or _own_tensors(m)]
    if _sequential_all_the_way(module):
        return layers
    if example_input is None:
        raise ValueError(f"{type(module).__name__} is not an nn.Sequential: the order its layers "
                         f"run in is known only by running it; pass example_input")
    return _run_order(module, layers, example_input, type(module).__name__)


def _run_order(model, modules: list, example_input, what: str) -> list:
    """``modules`` in the order ``model(example_input)`` calls them, each exactly once
    where it holds tensors or pairs with something."""
    order: list = []
    handles = [m.register_forward_pre_hook(lambda m, args: order.append(m)) for m in modules]
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for handle in handles:
            handle.remove()
    counted = [m for m in modules if _pairs_with_something(m)]
    twice = [m for m in counted if order.count(m) > 1]
    unused = [m for m in counted if m not in order]
    if twice or unused:
        culprits = twice or unused
        raise ValueError(f"ambiguous: {sorted(str(m) for m in culprits)} "
                         f"{'run more than once' if twice else 'never run'} in "
                         f"{what}; the layers cannot pair one to one")
    return [m for i, m in enumerate(order) if m not in order[:i]]


def _sequential_all_the_way(module: nn.Module) -> bool:
    children = list(module.children())
    if not children:
        return True
    return type(module) is nn.Sequential and all(_sequential_all_the_way(c) for c in children)


def _pairs_with_something(module: nn.Module) -> bool:
    return (_pairs_with_an_op(module) or isinstance(module, (Sequential, FusibleSpec))
            or bool(_own_tensors(module)))


def _outside(model: nn.Module, fusible: list) -> list:
    """``model``'s modules that are not inside a fusible one."""
    if any(model is f for f in fusible):
        return []
    return [model] + [m for c in model.children() for m in _outside(c, fusible)]


def _is_op(module) -> bool:
    return isinstance(module, BasicOperationSpec)


def _describe(module) -> str:
    return module.describe() if _is_op(module) else f"{type(module).__name__} (an ordinary module)"


def _own_tensors(module: nn.Module) -> list:
    """``(name, tensor)`` of the parameters and persistent buffers ``module`` itself
    holds."""
    skip = module._non_persistent_buffers_set
    own = [*module._parameters.items(),
           *((n, b) for n, b in module._buffers.items() if n not in skip)]
    return [(n, t) for n, t in own if t is not None]


def _shapes(module: nn.Module) -> dict:
    return {n: tuple(t.shape) for n, t in _own_tensors(module)}


def _tensor_names(model: nn.Module) -> dict:
    """``{id(tensor): (every name of it in model.state_dict())}``."""
    names: dict = collections.defaultdict(tuple)
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        names[id(t)] += (name,)
    return names


def _pairs(src: nn.Module):
    """(parameter names, fusible op type, settings) for each fusible op ``src`` maps to."""
    if isinstance(src, nn.Linear):
        yield ("weight",), BasicLinear, (src.in_features, src.out_features)
        if src.bias is not None:
            yield ("bias",), Bias, (src.out_features,)
    elif isinstance(src, nn.LayerNorm):
        if src.weight is None or src.bias is None:
            raise ValueError(f"{src} has no counterpart: ops.LayerNorm has a weight and a bias")
        yield ("weight", "bias"), LayerNorm, (tuple(src.normalized_shape), src.eps)
    elif isinstance(src, nn.RMSNorm):
        if src.weight is None:
            raise ValueError(f"{src} has no counterpart: ops.RMSNorm has a weight")
        if src.eps is None:
            raise ValueError(f"{src} has eps=None (the machine epsilon of the input's dtype): "
                             f"give it an eps, and ops.RMSNorm the same")
        yield ("weight",), RMSNorm, (tuple(src.normalized_shape), src.eps)
    elif type(src) in _ACTIVATIONS:
        yield (), _ACTIVATIONS[type(src)], _activation_settings(src)


def _activation_settings(module) -> tuple:
    return (module.approximate,) if isinstance(module, (nn.GELU, GELU)) else ()


def _settings(op) -> tuple:
    if isinstance(op, BasicLinear):
        return (op.in_features, op.out_features)
    if isinstance(op, Bias):
        return (op.size,)
    if isinstance(op, (LayerNorm, RMSNorm)):
        return (tuple(op.normalized_shape), op.eps)
    return _activation_settings(op)
