"""Weights between a fusible model and its ``torch.nn`` twin, both ways: the paired
tensors (:mod:`fusible.models.layer_pairing`) copied, tensor-parallel shards cut or
gathered, DTensors laid out as their parameters."""

from __future__ import annotations

import sys
from typing import Any, cast

import torch
from torch import nn

from fusible.core.operation import is_dtensor
from fusible.functional import parallel
from fusible.models.layer_pairing import paired
from fusible.ops.basic_linear import BasicLinear, linear_shard
from fusible.ops.bias import Bias


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
    for pair in paired(model, torch_module, example_input):
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
    for pair in paired(model, torch_module, example_input):
        result.update(dict.fromkeys(pair.source_names, _full_value(pair.op, pair.target)))
    return result


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
