"""The LM head's GEMMs, a chunk of tokens at a time, in high precision or FP8: the logits
``x @ W.T`` and the hidden states' gradient ``dz @ W`` in FP8 under per-tensor current
scaling (``x`` and ``W`` cast once for all the chunks, each chunk's logit gradient cast on
its own), the weight's gradient ``dz.T @ x`` always in high precision (an FP8 GEMM has no
accumulating input, and writing each chunk's ``(vocab, hidden)`` product to add it would
cost more memory traffic than the GEMM saves), summed over the chunks in the weight
gradient's dtype: each chunk's GEMM sums its products in float32 and adds its result into
the gradient (``addmm_``), rounding once per chunk, so no float32 copy of the weight
exists (twice the weight's memory, which would set the head's peak). A float32 gradient
(``main_grad``) is summed in float32, and so is a 16-bit one over more than eight chunks
(then rounded once: ``cross_entropy.wgrad_sum_dtype``)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.core.schema import SchemaType, register_schema_type
from fusible.quantization.casts.tensorwise import cast_tensorwise
from fusible.quantization.gemm import scaled_gemm

Tensor = torch.Tensor


@attrs.frozen
class HeadFp8:
    """The FP8 dtypes of the head's operands (per-tensor current scaling).

    Attributes
    ----------
    input_dtype, weight_dtype, grad_dtype : torch.dtype
        The hidden states', the weight's and the logits' gradient's FP8 dtypes (the
        recipe's formats).
    """

    input_dtype: torch.dtype
    weight_dtype: torch.dtype
    grad_dtype: torch.dtype


# None, or the three dtypes: constants of a compiled graph
register_schema_type(Optional[HeadFp8], SchemaType(
    ("ScalarType?", "ScalarType?", "ScalarType?"),
    lambda v: [None] * 3 if v is None else [v.input_dtype, v.weight_dtype, v.grad_dtype],
    lambda vals: None if vals[0] is None else HeadFp8(*vals)))


def mm_float32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` written in float32 for 16-bit ``a`` and ``b`` (their products summed in
    float32, not rounded to their dtype): on CUDA one GEMM with a float32 output, elsewhere
    the GEMM of their float32 copies (the same products)."""
    if a.dtype not in (torch.bfloat16, torch.float16):
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(torch.float32) @ b.to(torch.float32)


def accumulate_mm(acc: Optional[Tensor], a: Tensor, b: Tensor) -> Tensor:
    """``acc + a @ b`` (``acc`` None: ``a @ b``), in float32 for 16-bit ``a`` and ``b``: the
    product's float32 GEMM added into ``acc`` (not ``addmm(..., out_dtype=)``, whose
    decomposition fails under fake tensors in PyTorch 2.11: the same code runs compiled)."""
    if acc is None:
        return mm_float32(a, b)
    return acc.add_(mm_float32(a, b))


class HeadOperands:
    """``x`` (tokens, hidden) and ``weight`` (vocab, hidden) as the chunk GEMMs read them:
    as they are, or (``fp8``) cast to FP8 once, the weight with the transposed copy the
    hidden states' gradient reads when ``need_dgrad``."""

    def __init__(self, x: Tensor, weight: Tensor, fp8: Optional[HeadFp8], need_dgrad: bool):
        self.x, self.weight, self.fp8 = x, weight, fp8
        if fp8 is not None:
            self.x_data, self.x_scale_inv = cast_tensorwise(x, fp8.input_dtype)[:2]
            cast = cast_tensorwise(weight, fp8.weight_dtype, columnwise=need_dgrad)
            self.w_data, self.w_scale_inv = cast[0], cast[1]
            self.w_transposed = cast[2] if need_dgrad else None

    def logits(self, lo: int, hi: int) -> Tensor:
        """The logits of tokens ``lo:hi``, in ``x``'s dtype (rounded once, as a GEMM's)."""
        if self.fp8 is None:
            return self.x[lo:hi] @ self.weight.t()
        return scaled_gemm(self.x_data[lo:hi], self.x_scale_inv, self.w_data.t(),
                           self.w_scale_inv, None, self.x.dtype, fast_accum=True)

    def dgrad(self, dz: Tensor, out_dtype: torch.dtype) -> Tensor:
        """``dz @ weight`` for a chunk's logit gradient ``dz`` (``x``'s dtype), in
        ``out_dtype`` (float32: the products' float32 sums, unrounded)."""
        if self.fp8 is None:
            return mm_float32(dz, self.weight) if out_dtype == torch.float32 else dz @ self.weight
        assert self.w_transposed is not None  # cast with need_dgrad
        dz_data, dz_scale_inv = cast_tensorwise(dz, self.fp8.grad_dtype)[:2]
        return scaled_gemm(dz_data, dz_scale_inv, self.w_transposed.t(), self.w_scale_inv,
                           None, out_dtype)

    def wgrad(self, acc: Optional[Tensor], dz: Tensor, lo: int, hi: int,
              dtype: torch.dtype) -> Tensor:
        """``acc + dz.T @ x[lo:hi]`` in ``dtype`` (``acc`` None: the first chunk's), in
        place (see the module notes)."""
        a, b = dz.t(), self.x[lo:hi]
        if dtype != dz.dtype:  # float32 sums of 16-bit products
            return accumulate_mm(acc, a, b)
        return torch.mm(a, b) if acc is None else acc.addmm_(a, b)
