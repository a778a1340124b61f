"""SwiGLU, the gated SiLU of Llama-style feed-forward blocks, the clamped SwiGLU of
GPT-OSS and the SiTU-GLU of Kimi K3."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fusible.core import checks
from fusible.core.example import Example
from fusible.ops.glu import GatedActivation


class SwiGLU(GatedActivation):
    """Gated SiLU: ``a, b = x.chunk(2, -1); y = silu(a) * b``.

    The last dimension halves. Computes in float32 for 16-bit inputs; on CUDA one Triton
    kernel each way, which under an FP8 recipe writes the next linear layer's input (or
    the previous one's gradient) in FP8 directly. Options as
    :class:`~fusible.ops.glu.GatedActivation`'s.

    Notes
    -----
    Saves a :class:`~fusible.ops.glu.GLUSaved`: its input when the input needs a gradient.
    """

    kind = "swiglu"
    gate_reference = staticmethod(F.silu)


class ClampedOptions:
    """GPT-OSS's clamp (``limit``, ``alpha``, ``glu_linear_offset``), shared by
    :class:`ClampedSwiGLU` and its scaled form; mixed in before the unit's base."""

    kind = "clamped_swiglu"
    attribute_checks = {**GatedActivation.attribute_checks,
                        "limit": checks.real("limit", minimum=0.0),
                        "alpha": checks.real("alpha"),
                        "glu_linear_offset": checks.real("glu_linear_offset")}

    def __init__(self, *, limit: float = 7.0, alpha: float = 1.702,
                 glu_linear_offset: float = 1.0, **options):
        super().__init__(**options)
        self.limit, self.alpha, self.glu_linear_offset = limit, alpha, glu_linear_offset

    def options(self) -> tuple:
        return (("limit", self.limit), ("alpha", self.alpha),
                ("glu_linear_offset", self.glu_linear_offset))

    def clamp(self) -> tuple:
        return (self.limit, self.alpha, self.glu_linear_offset)

    def unit_reference(self, a, b):  # not gate(a) * b: both halves are clamped
        a, b = a.clamp(max=self.limit), b.clamp(-self.limit, self.limit)
        return a * torch.sigmoid(self.alpha * a) * (b + self.glu_linear_offset)


class ClampedSwiGLU(ClampedOptions, GatedActivation):
    """GPT-OSS's SwiGLU, as TransformerEngine's ``ClampedSwiGLU``:
    ``a' = min(a, limit)``, ``b' = clamp(b, -limit, limit)``,
    ``y = a' * sigmoid(alpha * a') * (b' + glu_linear_offset)``.

    The halves are ``x.chunk(2, -1)`` (GPT-OSS's own code interleaves them one by one:
    ``glu_interleave_size=1``). The gradient is zero where a clamp bites (the bounds
    themselves pass, as with ``torch.clamp``). One Triton kernel each way on CUDA, FP8
    output as SwiGLU's.

    Parameters
    ----------
    limit : float
        The clamp limit, at least 0.
    alpha : float
        The sigmoid's scale.
    glu_linear_offset : float
        Added to the clamped linear half (0 disables it).
    glu_interleave_size, cache_quantized_input
        As :class:`~fusible.ops.glu.GatedActivation`'s.
    """

    @classmethod
    def example(cls):
        # small enough a limit that the clamps bite on standard normal inputs
        return Example((cls(limit=1.5, glu_interleave_size=4),), (3, 5, 64))


def _either(op: str, name: str, value, default, alias: str, alias_value):
    """``value``, or its TransformerEngine alias's where that is given (``value`` then left
    at its ``default``)."""
    if alias_value is None:
        return value
    if value != default:
        raise TypeError(f"{op}: {name} and {alias} name the same cap; got both ({value!r}, "
                        f"{alias_value!r})")
    return alias_value


class SiTUOptions:
    """SiTU-GLU's caps (``gate_scale``, ``linear_scale``, ``linear_offset``), shared by
    :class:`SiTUGLU` and its scaled form; mixed in before the unit's base."""

    kind = "situ_glu"
    attribute_checks = {**GatedActivation.attribute_checks,
                        "gate_scale": checks.positive_real("gate_scale"),
                        "linear_scale": checks.optional(checks.positive_real("linear_scale")),
                        "linear_offset": checks.real("linear_offset")}

    def __init__(self, *, gate_scale: float = 4.0, linear_scale: Optional[float] = 25.0,
                 linear_offset: float = 0.0, beta1: Optional[float] = None,
                 beta2: Optional[float] = None, **options):
        super().__init__(**options)
        name = type(self).__name__
        # TransformerEngine names the caps beta1 and beta2: either name is accepted
        self.gate_scale = _either(name, "gate_scale", gate_scale, 4.0, "beta1", beta1)
        self.linear_scale = _either(name, "linear_scale", linear_scale, 25.0, "beta2", beta2)
        self.linear_offset = linear_offset

    @property
    def beta1(self) -> float:
        """TransformerEngine's name of ``gate_scale``."""
        return self.gate_scale

    @property
    def beta2(self) -> Optional[float]:
        """TransformerEngine's name of ``linear_scale``."""
        return self.linear_scale

    def options(self) -> tuple:
        return (("gate_scale", self.gate_scale), ("linear_scale", self.linear_scale),
                ("linear_offset", self.linear_offset))

    def clamp(self) -> tuple:  # the kernels' three parameters; 0 for an uncapped linear half
        return (self.gate_scale, self.linear_scale or 0.0, self.linear_offset)

    def unit_reference(self, a, b):
        gate = self.gate_scale * torch.tanh(a / self.gate_scale) * torch.sigmoid(a)
        linear = b if self.linear_scale is None else (
            self.linear_scale * torch.tanh(b / self.linear_scale))
        return gate * (linear + self.linear_offset)


class SiTUGLU(SiTUOptions, GatedActivation):
    """SiTU-GLU (the sigmoid-tanh unit of Kimi K3; Megatron-LM's ``situ_glu``): SwiGLU with
    soft caps on both factors,
    ``y = s tanh(a/s) sigmoid(a) * (l tanh(b/l) + linear_offset)``, bounded by
    ``s (l + |linear_offset|)`` and SwiGLU's to first order near the origin. One Triton
    kernel each way on CUDA, FP8 output as SwiGLU's.

    Parameters
    ----------
    gate_scale : float
        ``s``, the cap of the gate half (positive).
    linear_scale : float or None
        ``l``, the cap of the linear half (positive); None leaves it uncapped.
    linear_offset : float
        Added to the (capped) linear half.
    beta1, beta2 : float, optional
        TransformerEngine's names of ``gate_scale`` and ``linear_scale`` (give one name
        of each cap; ``op.beta1`` and ``op.beta2`` read them too).
    glu_interleave_size, cache_quantized_input
        As :class:`~fusible.ops.glu.GatedActivation`'s.
    """

    @classmethod
    def example(cls):
        # caps small enough to bend standard normal inputs
        return Example((cls(gate_scale=1.5, linear_scale=0.75, linear_offset=0.25,
                            glu_interleave_size=4),), (3, 5, 64))
