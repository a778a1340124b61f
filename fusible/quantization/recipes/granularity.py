"""The base of the built-in recipes: every tensor role's format at one granularity (a
registered scaling's name), E4M3 forward, and the gradients' FP8 dtype by ``fp8_format``."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

from fusible.quantization.format import Float8Format
from fusible.quantization.recipes.base import Recipe

_FORMATS = {
    "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2),
    "e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
}


def check_fp8_format(recipe, attribute, value) -> None:
    if value not in _FORMATS:
        raise ValueError(f"{type(recipe).__name__}: fp8_format must be one of "
                         f"{sorted(_FORMATS)}, got {value!r}")


@attrs.frozen
class GranularityRecipe(Recipe):
    """Every role's format at the ``granularity`` (a registered scaling's name) of the
    subclass (``weight_granularity`` for weights, if set), E4M3 forward and
    ``fp8_format``'s gradients: the base of the built-in recipes."""

    if TYPE_CHECKING:  # read-only, for the type checker: a subclass may compute it
        @property
        def granularity(self) -> str: ...
    else:
        granularity: ClassVar[str] = ""
    weight_granularity: ClassVar[str] = ""
    fp8_format: str = attrs.field(default="hybrid", validator=check_fp8_format)

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 dtype of inputs and weights."""
        return _FORMATS[self.fp8_format][0]

    @property
    def backward_dtype(self) -> torch.dtype:
        """FP8 dtype of gradients."""
        return _FORMATS[self.fp8_format][1]

    def input_format(self, columnwise: bool = False) -> Float8Format:
        """The format of a GEMM's input (activations)."""
        return Float8Format(self.forward_dtype, columnwise, self.granularity)

    def weight_format(self, columnwise: bool = False) -> Float8Format:
        """The format of a GEMM's weight."""
        return Float8Format(self.forward_dtype, columnwise,
                            self.weight_granularity or self.granularity)

    def grad_format(self, columnwise: bool = False) -> Float8Format:
        """The format of a gradient a GEMM reads (dgrad and wgrad's ``dy``)."""
        return Float8Format(self.backward_dtype, columnwise, self.granularity)
