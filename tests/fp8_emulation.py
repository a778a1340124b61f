"""FP8 current scaling emulated from the formats' definitions, for references that check
the library's casts and GEMMs rather than reuse them."""

import torch

from fusible.testing import FP8Emulation
from fp8_formats import FP8_MAX

FLOAT32_MAX = torch.finfo(torch.float32).max


def quantize_dequantize(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``t`` scaled so that its absolute maximum maps to the format's largest value
    (a float32 scale, at most the largest float32; 1 for an all-zero tensor), rounded to
    the format, and scaled back, in ``t``'s dtype."""
    limit = FP8_MAX[fp8_dtype]
    amax = t.detach().abs().max().float()
    scale = torch.tensor(limit, dtype=torch.float32) / amax if amax > 0 else torch.ones(())
    scale = scale.clamp(max=FLOAT32_MAX)
    data = (t.detach().float() * scale).clamp(-limit, limit).to(fp8_dtype)
    return (data.double() * (1 / scale).double()).to(t.dtype)


def emulation(recipe) -> FP8Emulation:
    """The reference's FP8 GEMM operands under ``recipe`` (its formats, our constants)."""
    return FP8Emulation(recipe, lambda t: quantize_dequantize(t, recipe.forward_dtype),
                        lambda t: quantize_dequantize(t, recipe.backward_dtype))
