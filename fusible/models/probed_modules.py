"""Modules recognised by what they compute: a norm class of a model's own code (Hugging
Face's ``LlamaRMSNorm``, Gemma's ``1 + weight`` one, nanoGPT's ``LayerNorm``) or an
activation class (transformers' ``SiLUActivation``, ``GELUActivation``, ...) becomes the
fusible op that computes the same on probe inputs, holding the module's own parameters.

The probe runs a float32 copy of the module and of each candidate op on random inputs
(random norm weights, so that ``w`` and ``1 + w`` differ) and takes the first candidate
within :data:`PROBE_TOLERANCE` of the module's largest output."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from fusible.models.layer_converter import norm_eps
from fusible.ops.gelu import GELU
from fusible.ops.layer_norm import LayerNorm
from fusible.ops.relu import ReLU
from fusible.ops.rms_norm import RMSNorm
from fusible.ops.silu import SiLU

PROBE_TOLERANCE = 1e-5


def probed_module(module: nn.Module) -> Optional[nn.Module]:
    """The fusible op computing what ``module`` computes (its parameters the same
    objects), or None."""
    if module._modules or module._buffers:
        return None
    params = dict(module._parameters)
    if not params:
        return _probed_activation(module)
    return _probed_norm(module, params)


def _probed_norm(module: nn.Module, params: dict) -> Optional[nn.Module]:
    weight = params.get("weight")
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or \
            set(params) - {"weight", "bias"}:
        return None
    eps = norm_eps(module)
    if eps is None:
        return None
    size, bias = weight.numel(), params.get("bias")
    candidates: list[nn.Module]
    if bias is None:
        candidates = [RMSNorm(size, eps=eps, zero_centered_gamma=z, device="meta",
                              dtype=weight.dtype) for z in (False, True)]
    else:
        candidates = [LayerNorm(size, eps=eps, zero_centered_gamma=z, device="meta",
                                dtype=weight.dtype) for z in (False, True)]
    for candidate in candidates:
        if _agrees(module, candidate, params):
            for name, p in params.items():
                setattr(candidate, name, p)
            return candidate
    return None


def _probed_activation(module: nn.Module) -> Optional[nn.Module]:
    for candidate in (SiLU(), GELU(), GELU(approximate="tanh"), ReLU()):
        if _agrees(module, candidate, {}):
            return candidate
    return None


def _agrees(module: nn.Module, candidate: nn.Module, params: dict) -> bool:
    """``module`` and ``candidate`` (float32 copies, the same random parameters) agree on
    a random input."""
    device = next(iter(params.values())).device if params else torch.device("cpu")
    if device.type == "meta":
        return False
    generator = torch.Generator(device).manual_seed(0)
    ours = copy.deepcopy(module).float()
    theirs = copy.deepcopy(candidate).to_empty(device=device).float()
    with torch.no_grad():
        for name in params:
            value = torch.rand(params[name].shape, generator=generator, device=device) + 0.5
            getattr(ours, name).copy_(value)
            getattr(theirs, name).copy_(value)
        size = params["weight"].numel() if params else 64
        x = torch.randn(4, 8, size, generator=generator, device=device) * 3
        try:
            want, got = ours(x), theirs(x)
        except Exception:  # noqa: BLE001 - a module that does not take this input is no match
            return False
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        return False
    error = (want - got).abs().max().item()
    return error <= PROBE_TOLERANCE * max(want.abs().max().item(), 1e-30)

