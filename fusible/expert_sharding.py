"""Expert parallelism with FSDP2 on a ``("dp", "ep")`` mesh: :func:`shard_experts`, and
checkpoints of that layout that load at any other (:func:`experts_to_global`,
:func:`experts_to_local`).

An expert-parallel block is a :class:`fusible.ops.Sequential` that dispatches its rows
with an ``AllToAll`` (or ``AllToAllEqual``) over the mesh's "ep" group and holds this ep
rank's experts in its ``GroupedLinear`` ops (``E / ep`` of them: ep rank ``j`` holds
experts ``j * E / ep`` onwards). The experts are sharded over "dp" (the ranks that hold
the same experts); everything else over the whole mesh, as the user's ``fully_shard``
calls decide. A local expert's gradient sums the rows of every rank of its ep group, and
the reduction over "dp" adds the other groups': divided by the whole mesh's size, it is
the gradient of the mean loss over all ranks, as the dense parameters' is.

In a state dict from ``torch.distributed.checkpoint.state_dict.get_state_dict`` the
experts' entries are FSDP2's shards of this ep rank's experts, which the other ep ranks
save under the same names with other values: :func:`experts_to_global` turns each into a
shard of the whole ``(E, ...)`` tensor (a DTensor over the mesh as ``("ep", "dp")``), so
that DCP saves every expert once and loads them into any mesh shape;
:func:`experts_to_local` turns them back before ``set_state_dict``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from fusible.ops.all_to_all import AllToAll, AllToAllEqual
from fusible.ops.grouped_linear import GroupedLinear
from fusible.module import Sequential


def expert_parameters(model: nn.Module, ep_size: int) -> dict:
    """``{name: number of experts in all}`` of the expert parameters of ``model``'s
    expert-parallel blocks (the ``GroupedLinear`` weights and biases of each Sequential
    that holds an all-to-all), checking that each block's all-to-all spans ``ep_size``
    ranks."""
    found = {}
    for path, block in _expert_blocks(model).items():
        sizes = {op.parallel.world_size for op in block.modules()
                 if isinstance(op, (AllToAll, AllToAllEqual))}
        if sizes != {ep_size}:
            raise ValueError(f"{path}: its all-to-alls span {sorted(sizes)} ranks, not the "
                             f"mesh's ep size {ep_size}")
        for name, module in block.named_modules():
            if isinstance(module, GroupedLinear):
                for leaf, param in module.named_parameters(recurse=False):
                    parts = [p for p in (path, name, leaf) if p]
                    found[".".join(parts)] = param.shape[0] * ep_size
    return found


def _expert_blocks(model: nn.Module) -> dict:
    return {path: m for path, m in model.named_modules()
            if isinstance(m, Sequential) and any(isinstance(op, (AllToAll, AllToAllEqual))
                                                 for op in m.children())}


def shard_experts(model: nn.Module, mesh: Any, *, dp_dim: str = "dp", ep_dim: str = "ep",
                  **fully_shard_kwargs: Any) -> list:
    """``fully_shard`` each expert-parallel block of ``model`` over ``mesh[dp_dim]``, its
    gradients divided by the whole mesh's size (see the module notes). Call it before
    sharding the rest of the model (over the whole mesh, flattened).

    Parameters
    ----------
    model : nn.Module
        Holding expert-parallel blocks whose all-to-alls run over ``mesh[ep_dim]``.
    mesh : DeviceMesh
        Two-dimensional, with dims named ``dp_dim`` and ``ep_dim``.
    **fully_shard_kwargs
        Passed to ``fully_shard`` (``mp_policy``, ``reshard_after_forward``).

    Returns
    -------
    list of str
        The sharded blocks' paths.

    Raises
    ------
    ValueError
        If the model has no expert-parallel block, or a block's all-to-all spans another
        number of ranks than ``mesh[ep_dim]``.
    """
    blocks = _expert_blocks(model)
    if not blocks:
        raise ValueError("shard_experts: the model has no expert-parallel block (an "
                         "ops.Sequential holding an AllToAll or AllToAllEqual)")
    expert_parameters(model, mesh[ep_dim].size())  # the groups checked
    for block in blocks.values():
        fully_shard(block, mesh=mesh[dp_dim], **fully_shard_kwargs)
        reduce_dtype = _reduce_dtype(block, fully_shard_kwargs.get("mp_policy"))
        block.set_gradient_divide_factor(_divide_factor(mesh.size(), mesh[dp_dim].size(),
                                                        reduce_dtype))
    return list(blocks)


def _reduce_dtype(block: nn.Module, mp_policy: Any) -> torch.dtype:
    """The dtype FSDP2 reduces ``block``'s gradients in."""
    if mp_policy is not None:
        dtype = mp_policy.reduce_dtype or mp_policy.param_dtype
        if dtype is not None:
            return dtype
    return next(block.parameters()).dtype


def _divide_factor(total: int, dp_size: int, reduce_dtype: torch.dtype) -> float:
    """The factor for ``set_gradient_divide_factor`` that divides the gradients by
    ``total``: on a one-rank "dp" mesh FSDP2 (torch 2.11 to 2.13) divides a reduction in
    another dtype than float32 or bfloat16 by the factor and again by its pre- and
    post-division (``total`` squared): there the square root."""
    if dp_size == 1 and reduce_dtype not in (torch.float32, torch.bfloat16):
        return math.sqrt(total)
    return float(total)


def experts_to_global(state: dict, model: nn.Module, mesh: Any, *, dp_dim: str = "dp",
                      ep_dim: str = "ep") -> dict:
    """``state`` (``{"model": ..., "optim": ...}`` or one model state dict, from
    ``get_state_dict``) with each expert entry, and its optimizer states, a shard of the
    whole ``(E, ...)`` tensor: for ``torch.distributed.checkpoint`` to save and load."""
    return _convert(state, model, mesh, dp_dim, ep_dim, to_global=True)


def experts_to_local(state: dict, model: nn.Module, mesh: Any, *, dp_dim: str = "dp",
                     ep_dim: str = "ep") -> dict:
    """The inverse of :func:`experts_to_global` (after ``dcp.load``): each expert entry
    FSDP2's shard of this ep rank's experts again, for ``set_state_dict``."""
    return _convert(state, model, mesh, dp_dim, ep_dim, to_global=False)


def _convert(state: dict, model, mesh, dp_dim: str, ep_dim: str, to_global: bool) -> dict:
    experts = expert_parameters(model, mesh[ep_dim].size())
    layout = _Layout(mesh, dp_dim, ep_dim)
    convert = layout.to_global if to_global else layout.to_local

    def entries(d: dict) -> dict:
        return {k: (convert(v, experts[k]) if k in experts and _is_tensor(v) else v)
                for k, v in d.items()}
    if "model" not in state:
        return entries(state)
    out = dict(state, model=entries(state["model"]))
    if "optim" in state:  # an expert's optimizer states laid out as the expert
        optim = state["optim"]
        out["optim"] = dict(optim, state={
            k: ({n: convert(t, experts[k]) if _is_tensor(t) and t.dim() else t
                 for n, t in v.items()} if k in experts else v)
            for k, v in optim["state"].items()})
    return out


def _is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


class _Layout:
    """The experts' two layouts: FSDP2's (a DTensor over "dp", this ep rank's experts)
    and the whole one (a DTensor over ("ep", "dp"): dim 0 split by ep, then by dp)."""

    def __init__(self, mesh, dp_dim: str, ep_dim: str):
        self.dp = mesh[dp_dim]
        names = mesh.mesh_dim_names
        grid = mesh.mesh if names.index(ep_dim) == 0 else mesh.mesh.transpose(0, 1)
        self.ep_dp = DeviceMesh(mesh.device_type, grid, mesh_dim_names=(ep_dim, dp_dim))

    def to_global(self, t, experts: int):
        local = t.to_local() if isinstance(t, DTensor) else t
        shape = torch.Size((experts, *t.shape[1:]))
        return DTensor.from_local(local, self.ep_dp, [Shard(0), Shard(0)], run_check=False,
                                  shape=shape, stride=_contiguous_strides(shape))

    def to_local(self, t, experts: int):
        local = t.to_local() if isinstance(t, DTensor) else t
        ep = self.ep_dp.size(0)
        shape = torch.Size((experts // ep, *t.shape[1:]))
        return DTensor.from_local(local, self.dp, [Shard(0)], run_check=False, shape=shape,
                                  stride=_contiguous_strides(shape))


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
