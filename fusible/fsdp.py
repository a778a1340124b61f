"""FSDP2 with FP8 weight all-gathers: :func:`fsdp_float8_all_gather`."""

from __future__ import annotations

import torch
from torch import nn

from fusible.ops.basic_linear import BasicLinear
from fusible.ops.linear import Linear
from fusible.quantization.tensor.float8_tensor import Float8Tensor
from fusible.quantization.fsdp_weight import Float8AllGatherWeight


def fsdp_float8_all_gather(model: nn.Module,
                           fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> list:
    """Make FSDP2 all-gather the weights of ``model``'s linear layers in FP8.

    Call it before ``fully_shard``. Each ``BasicLinear`` / ``Linear`` weight becomes a
    :class:`~fusible.quantization.fsdp_weight.Float8AllGatherWeight` parameter (same name,
    values and dtype): the optimizer, state dicts and checkpoints see its high-precision
    values, while FSDP2 all-gathers it as FP8 bytes cast with one scale for the whole
    weight (the shards' absolute maxima all-reduced over the shard group), half the bytes
    of bf16, and hands the layer a Float8Tensor that its FP8 GEMMs read without a second
    cast. The outputs and gradients are those of gathering in high precision and
    quantizing, bit for bit; the weight gradients are reduce-scattered in high precision.

    Every gather of a wrapped weight is in FP8 (FSDP2 gathers into the buffers of the
    first), so run the model under ``fusible.autocast()`` with a recipe that scales the
    weights per tensor (current scaling); outside it, the layers dequantize the FP8
    weight, computing with its rounded values.

    Parameters
    ----------
    model : nn.Module
        Searched for linear layers (any depth), not yet sharded.
    fp8_dtype : torch.dtype
        The weights' FP8 format: E4M3, as the recipes quantize weights.

    Returns
    -------
    list of str
        The names of the wrapped weights.

    Raises
    ------
    ValueError
        If a weight is already sharded (``fully_shard`` ran first) or already FP8
        (``quantized_model_init``), naming it.
    """
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fsdp_float8_all_gather: {fp8_dtype=} is not an FP8 format")
    wrapped = []
    for name, module in model.named_modules():
        if not isinstance(module, (BasicLinear, Linear)):  # the modules owning a weight
            continue
        weight = module.weight
        if isinstance(weight, Float8AllGatherWeight):
            continue
        label = f"{name}.weight" if name else "weight"
        _check_plain(label, weight)
        module.weight = nn.Parameter(Float8AllGatherWeight(weight.data, fp8_dtype),
                                     requires_grad=weight.requires_grad)
        wrapped.append(label)
    return wrapped


def _check_plain(name: str, weight: torch.Tensor) -> None:
    if isinstance(weight, Float8Tensor):
        raise ValueError(f"fsdp_float8_all_gather: {name} is already an FP8 parameter "
                         f"(quantized_model_init); FSDP2 gathers it as it is")
    if type(weight.data) is not torch.Tensor:
        raise ValueError(f"fsdp_float8_all_gather: {name} is a {type(weight.data).__name__}, "
                         f"not a plain tensor; call it before fully_shard")
