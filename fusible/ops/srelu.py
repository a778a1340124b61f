"""SReLU: squared ReLU, ``relu(x)**2`` (Primer)."""

from __future__ import annotations

import torch

from fusible.core.example import Example
from fusible.ops.pointwise_activation import PointwiseActivation


class SReLU(PointwiseActivation):
    """Squared ReLU, ``relu(x)**2``, computed in float32 for 16-bit inputs."""

    kind = "srelu"

    def reference(self, x, extra_inputs, params):
        return torch.relu(x).square(), ()

    @classmethod
    def example(cls):
        return Example((cls(),), (6, 32))
