"""Loading weights of an equivalent ``torch.nn`` model into a fusible Sequential."""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from fusible.core.operation import BasicOperationSpec, is_dtensor
from fusible.functional import parallel
from fusible.module import Sequential
from fusible.ops.basic_linear import BasicLinear, linear_shard
from fusible.ops.bias import Bias
from fusible.ops.gelu import GELU
from fusible.ops.layer_norm import LayerNorm
from fusible.ops.relu import ReLU
from fusible.ops.rms_norm import RMSNorm
from fusible.ops.silu import SiLU

_ACTIVATIONS = {nn.GELU: GELU, nn.ReLU: ReLU, nn.SiLU: SiLU}
_PARAMETERISED = (nn.Linear, nn.LayerNorm, nn.RMSNorm)


def state_dict_from_torch(model: Sequential, torch_module: nn.Module,
                          example_input: Optional[torch.Tensor] = None) -> dict:
    """A state dict for ``model`` holding the parameters of an equivalent torch model.

    The torch model's layers are taken in the order they run: an ``nn.Sequential`` (nested
    ones included) runs its children in order; any other module is run once on
    ``example_input`` to see the order. They pair with ``model``'s operations in order:
    ``nn.Linear`` with a ``BasicLinear`` (plus the following ``Bias`` when it has a bias;
    an ``ops.Linear`` expands to exactly these), ``nn.LayerNorm`` / ``nn.RMSNorm`` with
    ``LayerNorm`` / ``RMSNorm``, and ``nn.GELU`` / ``nn.ReLU`` / ``nn.SiLU`` with the
    activation ops (when the torch model has activation modules at all). Every setting
    that changes results must agree (sizes, ``eps``, bias presence, elementwise affine,
    GELU's approximation); other modules without parameters are passed over, but
    ``nn.Dropout`` with ``p > 0`` is refused. Tensor-parallel ops get their rank's shard.

    Parameters
    ----------
    model : fusible.ops.Sequential
        The fusible model to load into.
    torch_module : nn.Module
        For example ``nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))``.
    example_input : Tensor, optional
        An input for ``torch_module``, needed when it is not an ``nn.Sequential``.

    Returns
    -------
    dict
        ``{name in model.state_dict(): tensor}``; pass it to ``model.load_state_dict``.

    Raises
    ------
    ValueError
        If the two models do not pair up, or a setting differs, naming the first mismatch;
        or when the order of the torch layers cannot be known.

    Examples
    --------
    >>> model.load_state_dict(fusible.state_dict_from_torch(model, torch_mlp))
    """
    sources = _torch_layers(torch_module, example_input)
    kinds: tuple[type[BasicOperationSpec], ...] = (BasicLinear, Bias, LayerNorm, RMSNorm)
    if any(type(s) in _ACTIVATIONS for s in sources):  # else its forward calls functions
        kinds += tuple(_ACTIVATIONS.values())
    ops = [op for op in model.pipeline() if isinstance(op, kinds)]
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    result, pos = {}, 0
    for src in sources:
        for params, target_type, settings in _pairs(src):
            if pos >= len(ops):
                raise ValueError(f"{src} has no counterpart: the fusible model has no more "
                                 f"ops to pair")
            op = ops[pos]
            if not isinstance(op, target_type) or _settings(op) != settings:
                raise ValueError(f"{src} does not pair with {op.describe()} (op {pos} to pair "
                                 f"in the fusible model): {target_type.__name__} with "
                                 f"{settings} expected, it has {_settings(op)}")
            for param, value in zip(op.fusible_params(), params):
                result[names[id(param)]] = _as_param(param, _local_shard(op, value.detach()))
            pos += 1
    if pos != len(ops):
        raise ValueError(f"{ops[pos].describe()} and later ops have no counterpart in "
                         f"{type(torch_module).__name__}")
    return result


def _torch_layers(module: nn.Module, example_input) -> list:
    """The torch model's leaf modules, in the order they run."""
    leaves = [m for m in module.modules() if not list(m.children())]
    if _sequential_all_the_way(module):
        return leaves
    if example_input is None:
        raise ValueError(f"{type(module).__name__} is not an nn.Sequential: the order its layers "
                         f"run in is known only by running it; pass example_input")
    order: list = []
    handles = [m.register_forward_pre_hook(lambda m, args: order.append(m)) for m in leaves]
    try:
        with torch.no_grad():
            module(example_input)
    finally:
        for handle in handles:
            handle.remove()
    twice = {m for m in order if order.count(m) > 1 and _pairs_with_something(m)}
    unused = [m for m in leaves if m not in order and _pairs_with_something(m)]
    if twice or unused:
        what = twice or unused
        raise ValueError(f"ambiguous: {sorted(str(m) for m in what)} "
                         f"{'run more than once' if twice else 'never run'} in "
                         f"{type(module).__name__}; the layers cannot pair one to one")
    return order


def _sequential_all_the_way(module: nn.Module) -> bool:
    children = list(module.children())
    if not children:
        return True
    return type(module) is nn.Sequential and all(_sequential_all_the_way(c) for c in children)


def _pairs_with_something(module: nn.Module) -> bool:
    return isinstance(module, _PARAMETERISED) or type(module) in _ACTIVATIONS


def _pairs(src: nn.Module):
    """(parameters, fusible op type, settings) for each fusible op ``src`` maps to."""
    if isinstance(src, nn.Linear):
        yield (src.weight,), BasicLinear, (src.in_features, src.out_features)
        if src.bias is not None:
            yield (src.bias,), Bias, (src.out_features,)
    elif isinstance(src, nn.LayerNorm):
        if src.weight is None or src.bias is None:
            raise ValueError(f"{src} has no counterpart: ops.LayerNorm has a weight and a bias")
        yield (src.weight, src.bias), LayerNorm, (tuple(src.normalized_shape), src.eps)
    elif isinstance(src, nn.RMSNorm):
        if src.weight is None:
            raise ValueError(f"{src} has no counterpart: ops.RMSNorm has a weight")
        if src.eps is None:
            raise ValueError(f"{src} has eps=None (the machine epsilon of the input's dtype): "
                             f"give it an eps, and ops.RMSNorm the same")
        yield (src.weight,), RMSNorm, (tuple(src.normalized_shape), src.eps)
    elif type(src) in _ACTIVATIONS:
        yield (), _ACTIVATIONS[type(src)], _activation_settings(src)
    elif isinstance(src, nn.Dropout) and src.p > 0:
        raise ValueError(f"{src} has no fusible counterpart with the same masks (ops.Dropout "
                         f"draws its own: results differ in training)")
    elif list(src.parameters(recurse=False)):
        raise ValueError(f"state_dict_from_torch cannot map {src}; supported: nn.Linear, "
                         f"nn.LayerNorm and nn.RMSNorm with affine parameters")


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
        return value[parallel.rank_slice(op.tp, op.local_size)]
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
