"""SiLU: the sigmoid linear unit."""

from __future__ import annotations

import torch.nn.functional as F

from fusible.core.example import Example
from fusible.ops.pointwise_activation import PointwiseActivation


class SiLU(PointwiseActivation):
    """Sigmoid linear unit, ``x * sigmoid(x)``."""

    kind = "silu"

    def reference(self, x, extra_inputs, params):
        return F.silu(x), ()

    @classmethod
    def example(cls):
        return Example((cls(),), (6, 32))
