"""torch.autocast around a fusible group: it computes in the autocast dtype, from
parameters cast to it (differentiably: their gradients come back in their own dtype), as
``nn.Linear`` does; under an FP8 recipe the weights the GEMMs quantize are passed as they
are (an FP8 cast from their own dtype, no detour through the autocast dtype)."""

from __future__ import annotations

import functools

import torch

from fusible.core.operation import CASTING


def run_autocast(runner, x, extra_inputs, training, params, traced, tensors, fp8: bool):
    """``runner.run`` of the cast inputs and parameters, with torch.autocast off inside
    (``fp8``: an FP8 recipe is in effect)."""
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type)
    keep = _quantized(runner) if fp8 else ()
    x = x.to(dtype)
    if any(getattr(op, "in_place", False) for op in runner.ops if op.num_extra_inputs) \
            and any(e.dtype != dtype for e in extra_inputs):
        raise TypeError(f"{runner.name()}: an AddExtraInput(in_place=True) writes into its "
                        f"extra input, which under torch.autocast must be in the autocast "
                        f"dtype {dtype}; got {[e.dtype for e in extra_inputs]}")
    extra_inputs = tuple(e.to(dtype) if e.is_floating_point() else e
                         for e in extra_inputs)  # split sizes stay integers
    params = [p if i in keep else p.to(dtype) for i, p in enumerate(params)]
    CASTING.active = True
    try:
        with torch.autocast(device_type, enabled=False):
            return runner.run(x, extra_inputs, training, params, traced, tensors)
    finally:
        CASTING.active = False


def _quantized(runner) -> frozenset:
    """The indices of the group's parameters that FP8 GEMMs quantize (``quantized_params``)."""
    found = runner.memory.get("quantized_params")
    if found is None:
        owners = [(op, name) for op in runner.ops for name in op.param_names]
        found = runner.memory["quantized_params"] = frozenset(
            i for i, (op, name) in enumerate(owners) if name in op.quantized_params)
    return found


@functools.lru_cache(maxsize=None)
def autocast_available(device_type: str) -> bool:
    """Whether torch.autocast exists for the device type (not for "meta")."""
    return torch.amp.is_autocast_available(device_type)
