"""Loading weights of an equivalent ``torch.nn`` model into a fusible Sequential."""

from __future__ import annotations

from torch import nn

from fusible.functional import parallel
from fusible.ops.basic_linear import BasicLinear, linear_shard
from fusible.ops.bias import Bias
from fusible.ops.layer_norm import LayerNorm
from fusible.ops.rms_norm import RMSNorm


def state_dict_from_torch(model, torch_module: nn.Module) -> dict:
    """A state dict for ``model`` holding the parameters of an equivalent torch model.

    The parametrised modules of ``torch_module`` (``nn.Linear``,
    ``nn.LayerNorm``, ``nn.RMSNorm``), in order, are paired with the basic ops
    of ``model`` that hold parameters: ``nn.Linear`` with a ``BasicLinear``
    (plus the following ``Bias`` when it has a bias; an ``ops.Linear`` expands
    to exactly these), the norms with ``LayerNorm`` / ``RMSNorm``. Modules
    without parameters (``nn.GELU``, ``nn.Dropout``, ...) are not paired.
    Tensor-parallel ops get their rank's shard of the full tensors.

    Parameters
    ----------
    model : fusible.ops.Sequential
        The fusible model to load into.
    torch_module : nn.Module
        For example ``nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))``.

    Returns
    -------
    dict
        ``{name in model.state_dict(): tensor}``; pass it to ``model.load_state_dict``.

    Raises
    ------
    ValueError
        If the two models do not pair up, naming the first mismatch.

    Examples
    --------
    >>> model.load_state_dict(fusible.state_dict_from_torch(model, torch_mlp))
    """
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    targets = [op for op in model.pipeline() if getattr(op, "fusible_params", lambda: ())()]
    sources = [m for m in torch_module.modules()
               if not list(m.children()) and list(m.parameters(recurse=False))]
    result, pos = {}, 0
    for src in sources:
        for attr, target_type, expected in _pairs(src):
            if pos >= len(targets):
                raise ValueError(f"{src} has no counterpart: the fusible model has no more "
                                 f"ops with parameters")
            op = targets[pos]
            if not isinstance(op, target_type) or _sizes(op) != expected:
                raise ValueError(f"{src} does not pair with {op.describe()} (op {pos} with "
                                 f"parameters in the fusible model)")
            for param, value in zip(op.fusible_params(), attr):
                result[names[id(param)]] = _local_shard(op, value.detach())
            pos += 1
    if pos != len(targets):
        raise ValueError(f"{targets[pos].describe()} and later ops have no counterpart in "
                         f"{type(torch_module).__name__}")
    return result


def _pairs(src: nn.Module):
    """(parameters, fusible op type, sizes) for each fusible op ``src`` maps to."""
    if isinstance(src, nn.Linear):
        yield (src.weight,), BasicLinear, (src.in_features, src.out_features)
        if src.bias is not None:
            yield (src.bias,), Bias, (src.out_features,)
    elif isinstance(src, nn.LayerNorm) and src.weight is not None and src.bias is not None:
        yield (src.weight, src.bias), LayerNorm, tuple(src.normalized_shape)
    elif isinstance(src, getattr(nn, "RMSNorm", ())) and src.weight is not None:
        yield (src.weight,), RMSNorm, tuple(src.normalized_shape)
    else:
        raise ValueError(f"state_dict_from_torch cannot map {src}; supported: nn.Linear, "
                         f"nn.LayerNorm and nn.RMSNorm with affine parameters")


def _local_shard(op, value):
    """This rank's part of a full parameter: a parallel linear layer's or bias's shard."""
    if isinstance(op, BasicLinear):
        return value[linear_shard(op)]
    if isinstance(op, Bias) and op.tensor_parallel:
        return value[parallel.rank_slice(op.tp, op.local_size)]
    return value


def _sizes(op) -> tuple:
    if isinstance(op, BasicLinear):
        return (op.in_features, op.out_features)
    if isinstance(op, Bias):
        return (op.size,)
    return tuple(op.normalized_shape)
