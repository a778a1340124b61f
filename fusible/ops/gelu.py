"""GELU: the Gaussian error linear unit, exact or tanh-approximated."""

from __future__ import annotations

import torch.nn.functional as F

from fusible.core import checks
from fusible.core.example import Example
from fusible.ops.pointwise_activation import PointwiseActivation


class GELU(PointwiseActivation):
    """Gaussian error linear unit, exact (``approximate="none"``) or tanh-approximated.

    Parameters
    ----------
    approximate : {"none", "tanh"}
        As ``torch.nn.GELU``.
    cache_quantized_input : bool
        As :class:`~fusible.ops.pointwise_activation.PointwiseActivation`.
    """

    attribute_checks = {**PointwiseActivation.attribute_checks,
                        "approximate": checks.one_of("approximate", ("none", "tanh"))}

    def __init__(self, approximate: str = "none", *, cache_quantized_input: bool = False):
        super().__init__(cache_quantized_input=cache_quantized_input)
        self.approximate = approximate

    @property
    def kind(self) -> str:
        return "gelu_tanh" if self.approximate == "tanh" else "gelu"

    def extra_repr(self) -> str:
        cached = super().extra_repr()
        return f"approximate={self.approximate!r}" + (f", {cached}" if cached else "")

    def reference(self, x, extra_inputs, params):
        return F.gelu(x, approximate=self.approximate), ()

    @classmethod
    def example(cls):
        return Example((cls(approximate="tanh"),), (3, 5, 32))
