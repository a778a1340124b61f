"""SwiGLU: the gated SiLU of Llama-style feed-forward blocks."""

from __future__ import annotations

import torch.nn.functional as F

from fusible.ops.glu import GatedActivation


class SwiGLU(GatedActivation):
    """Gated SiLU: ``a, b = x.chunk(2, -1); y = silu(a) * b``.

    The last dimension halves. Computes in float32 for 16-bit inputs; on CUDA one Triton
    kernel each way, which under an FP8 recipe writes the next linear layer's input (or
    the previous one's gradient) in FP8 directly.

    Notes
    -----
    Saves a :class:`~fusible.ops.glu.GLUSaved`: its input when the input needs a gradient.
    """

    kind = "swiglu"
    gate_reference = staticmethod(F.silu)
