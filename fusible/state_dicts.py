"""Weights between a fusible model and its ``torch.nn`` twin, both ways."""

from __future__ import annotations

import collections
import sys
from typing import Any, Optional, cast

import attrs
import torch
from torch import nn

from fusible.core.operation import BasicOperationSpec, FusibleSpec, is_dtensor
from fusible.functional import parallel
from fusible.module import Sequential, outermost_fusible
from fusible.ops.basic_linear import BasicLinear, linear_shard
from fusible.ops.bias import Bias
from fusible.ops.gelu import GELU
from fusible.ops.layer_norm import LayerNorm
from fusible.ops.relu import ReLU
from fusible.ops.rms_norm import RMSNorm
from fusible.ops.silu import SiLU

_ACTIVATIONS = {nn.GELU: GELU, nn.ReLU: ReLU, nn.SiLU: SiLU}
_PARAMETERISED = (nn.Linear, nn.LayerNorm, nn.RMSNorm)


def state_dict_from_torch(model: nn.Module, torch_module: nn.Module,
                          example_input: Any = None) -> dict:
    """A state dict for ``model`` holding the parameters of an equivalent torch model.

    Both models are taken as layers in the order they run. On the torch side, an
    ``nn.Sequential`` (nested ones included) runs its children in order; any other module is
    run once on ``example_input`` to see the order. On the fusible side, a Sequential's
    pipeline gives the order; a whole model (any ``nn.Module`` holding fusible Sequentials
    and ordinary modules: an embedding, attention) is run once on ``example_input`` too.

    They pair in order: ``nn.Linear`` with a ``BasicLinear`` (plus the following ``Bias``
    when it has a bias; an ``ops.Linear`` expands to exactly these), ``nn.LayerNorm`` /
    ``nn.RMSNorm`` with ``LayerNorm`` / ``RMSNorm``, ``nn.GELU`` / ``nn.ReLU`` / ``nn.SiLU``
    with the activation ops (when the torch model has activation modules at all), and any
    other module holding parameters or buffers of its own (an ``nn.Embedding``, a learned
    position table) with the fusible model's ordinary module in the same place, which
    must hold the same names and shapes. Every setting that changes results must agree
    (sizes, ``eps``, bias presence, elementwise affine, GELU's approximation); modules
    without parameters are passed over, but ``nn.Dropout`` with ``p > 0`` is refused.
    Tensor-parallel ops get their rank's shard; DTensor parameters (FSDP2) get DTensors.
    A parameter shared by several modules (tied embeddings) is given under each name.

    Parameters
    ----------
    model : nn.Module
        The fusible model to load into: a ``fusible.ops.Sequential``, or a whole model.
    torch_module : nn.Module
        For example ``nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))``.
    example_input : Tensor or tuple, optional
        What both models are called with (a tuple: the positional arguments), needed
        when the order of either model's layers is known only by running it.

    Returns
    -------
    dict
        ``{name in model.state_dict(): tensor}``; pass it to ``model.load_state_dict``.

    Raises
    ------
    ValueError
        If the two models do not pair up, or a setting differs, naming the first mismatch;
        or when the order of the layers cannot be known.

    Examples
    --------
    >>> model.load_state_dict(fusible.state_dict_from_torch(model, torch_mlp))
    """
    result = {}
    for pair in _paired(model, torch_module, example_input):
        value = _as_param(pair.target, _local_shard(pair.op, pair.source.detach()))
        result.update(dict.fromkeys(pair.target_names, value))
    return result


def state_dict_to_torch(model: nn.Module, torch_module: nn.Module,
                        example_input: Any = None) -> dict:
    """The inverse of :func:`state_dict_from_torch`: a state dict for ``torch_module``
    holding ``model``'s parameters, the layers paired the same way.

    Tensor-parallel shards are gathered and DTensors made whole, so every rank of the group
    must call it (the result is the full tensors, on every rank).

    Parameters
    ----------
    model : nn.Module
        The fusible model to read: a ``fusible.ops.Sequential``, or a whole model.
    torch_module : nn.Module
        The equivalent ``torch.nn`` model (only its structure and settings are read).
    example_input : Tensor or tuple, optional
        As for :func:`state_dict_from_torch`.

    Returns
    -------
    dict
        ``{name in torch_module.state_dict(): tensor}``; pass it to
        ``torch_module.load_state_dict``.

    Raises
    ------
    ValueError
        As :func:`state_dict_from_torch`.

    Examples
    --------
    >>> torch_mlp.load_state_dict(fusible.state_dict_to_torch(model, torch_mlp))
    """
    result = {}
    for pair in _paired(model, torch_module, example_input):
        result.update(dict.fromkeys(pair.source_names, _full_value(pair.op, pair.target)))
    return result


@attrs.frozen
class _Pair:
    """One fusible tensor and its torch counterpart, with their state-dict names."""

    target: torch.Tensor
    target_names: tuple
    source: torch.Tensor
    source_names: tuple
    op: Optional[nn.Module]  # the fusible op (its shard), None for an ordinary module


_LINEAR_KINDS = (BasicLinear, Bias, LayerNorm, RMSNorm)


def _paired(model, torch_module, example_input) -> list:
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
            pairs += [_Pair(t, target_names[id(t)], source, source_names[id(source)], op)
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


def _as_param(param, value):
    """``value`` laid out as ``param``: a DTensor parameter (FSDP2's shards) gets a DTensor
    of the same mesh and placements, this rank's part taken locally (every rank holds the
    full value), so that ``load_state_dict`` copies shard into shard."""
    if not is_dtensor(param):
        return value
    distribute_tensor = sys.modules["torch.distributed.tensor"].distribute_tensor  # loaded
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None)


def _local_shard(op, value):
    """This rank's part of a full parameter: a parallel linear layer's or bias's shard."""
    if isinstance(op, BasicLinear):
        return value[linear_shard(op)]
    if isinstance(op, Bias) and op.tensor_parallel:
        return value[parallel.rank_slice(op.parallel, op.local_size)]
    return value


def _full_value(op, value: torch.Tensor) -> torch.Tensor:
    """The whole of a parameter: a DTensor's full tensor, a parallel layer's shards
    gathered (a collective: every rank of the group calls it)."""
    value = value.detach()
    if is_dtensor(value):
        value = cast(Any, value).full_tensor()
    if isinstance(op, BasicLinear) and op.parallel.active:
        if op.parallel.mode == "column":
            return parallel.all_gather(value, op.parallel)
        return parallel.all_gather(value.t().contiguous(), op.parallel).t().contiguous()
    if isinstance(op, Bias) and op.tensor_parallel:
        return parallel.all_gather(value, op.parallel)
    return value


def interleave_glu_rows(t: torch.Tensor, glu_interleave_size: int) -> torch.Tensor:
    """The rows of ``t`` (a gated unit's producer's weight, ``2F x in``, or bias, ``2F``),
    laid out as ``[a | b]`` (the two halves one after the other), reordered into
    alternating blocks of ``glu_interleave_size`` rows: ``[a_1..a_s, b_1..b_s, a_s+1..]``,
    the layout of a gated unit constructed with that ``glu_interleave_size``.

    What a gated unit after a column-parallel layer needs: with ``s`` dividing half of each
    rank's rows, every rank's contiguous slice of the interleaved rows holds whole pairs.
    Returns a new tensor; the inverse is ``deinterleave_glu_rows``.
    """
    rows, s = _glu_rows(t, glu_interleave_size, "interleave_glu_rows")
    return t.reshape(2, rows // (2 * s), s, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def deinterleave_glu_rows(t: torch.Tensor, glu_interleave_size: int) -> torch.Tensor:
    """The inverse of :func:`interleave_glu_rows`: ``[a | b]`` rows back from blocks."""
    rows, s = _glu_rows(t, glu_interleave_size, "deinterleave_glu_rows")
    return t.reshape(rows // (2 * s), 2, s, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _glu_rows(t: torch.Tensor, size: int, name: str) -> tuple:
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{name}: glu_interleave_size must be a positive int, got {size!r}")
    if t.dim() == 0 or t.shape[0] % (2 * size):
        raise ValueError(f"{name}: the rows of a {tuple(t.shape)} tensor must be a multiple "
                         f"of 2 * glu_interleave_size = {2 * size}")
    return t.shape[0], size
