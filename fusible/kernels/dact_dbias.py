"""Activation gradient fused with the bias gradient (the sum of that gradient over tokens)."""

from __future__ import annotations

import torch

from fusible.ops.activation import activation_backward
from fusible.ops.bias import bias_grad


def dact_dbias(kind: str, grad_output: torch.Tensor, saved: torch.Tensor):
    """Return ``(dact, dbias)`` for the pointwise activation ``kind``."""
    dact = activation_backward(kind, grad_output, saved)
    return dact, bias_grad(dact)
