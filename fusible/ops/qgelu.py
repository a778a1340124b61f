"""QGELU: quick GELU, ``x * sigmoid(1.702 x)``."""

from __future__ import annotations

import torch

from fusible.core.example import Example
from fusible.ops.pointwise_activation import PointwiseActivation


class QGELU(PointwiseActivation):
    """Quick GELU, ``x * sigmoid(1.702 x)`` (TransformerEngine's and Hugging Face's),
    computed in float32 for 16-bit inputs."""

    kind = "qgelu"

    def reference(self, x, extra_inputs, params):
        return x * torch.sigmoid(1.702 * x), ()

    @classmethod
    def example(cls):
        return Example((cls(),), (6, 32))
