"""FP8 parameters: ``quantized_model_init``, under which linear layers keep their weights
in FP8 (TransformerEngine's ``quantized_model_init``), with no high-precision copy on the
device."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import torch
from torch import nn

from fusible.quantization.recipes.current import Float8CurrentScaling
from fusible.quantization.tensor.quantize import quantize_raw

_STATE = threading.local()


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Any = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Create the weights of the linear layers built inside the block in FP8.

    Each ``BasicLinear`` / ``Linear`` weight is initialised as usual, then stored as a
    Float8Tensor parameter in the recipe's weight format (E4M3 with current scaling),
    holding its transposed copy for dgrad: no high-precision weight lives on the device.
    Under ``fusible.autocast`` the GEMMs read it as it is; outside, it is dequantized
    for each use. Gradients are high-precision tensors of the weight's dtype. In-place
    updates (an optimizer step, ``copy_``, ``load_state_dict``, ``nn.init``) run on its
    values and quantize them again with a new scale: small updates below the FP8 step
    are lost, so train with float32 master weights kept by the optimizer (docs/fp8.md).

    Parameters
    ----------
    enabled : bool
        False creates ordinary weights (to switch it with a flag).
    recipe : Recipe, optional
        Gives the weights' FP8 format; default ``Float8CurrentScaling()``.
    preserve_high_precision_init_val : bool
        Keep each weight's initial high-precision value on the CPU, as
        ``weight.high_precision_init_val`` (to initialise master weights from); drop it
        with ``del weight.high_precision_init_val``.
    """
    if recipe is not None and recipe.weight_format().granularity != "tensorwise":
        raise NotImplementedError(f"quantized_model_init: FP8 parameters hold one scale per "
                                  f"tensor, by current scaling, so far; {recipe!r} scales the "
                                  f"weights {recipe.weight_format().granularity}")
    previous = getattr(_STATE, "active", None)
    _STATE.active = ((recipe or Float8CurrentScaling(), preserve_high_precision_init_val)
                     if enabled else None)
    try:
        yield
    finally:
        _STATE.active = previous


def quantized_init_active() -> bool:
    """Whether weights created now are FP8 (inside ``quantized_model_init()``)."""
    return getattr(_STATE, "active", None) is not None


def fp8_parameter(param: nn.Parameter) -> nn.Parameter:
    """``param`` as an FP8 parameter when ``quantized_model_init`` is active (and the
    parameter is not on the meta device), else ``param`` itself."""
    active: Optional[tuple] = getattr(_STATE, "active", None)
    if active is None or param.device.type == "meta":
        return param
    recipe, preserve = active
    with torch.no_grad():
        weight = quantize_raw(param.detach(), recipe.weight_format().fp8_dtype, columnwise=True)
    out = nn.Parameter(weight, requires_grad=param.requires_grad)
    if preserve:
        # an extra attribute, which a Parameter takes (its stub declares none)
        setattr(out, "high_precision_init_val", param.detach().to("cpu", copy=True))
    return out
