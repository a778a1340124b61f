"""The records of a linear layer's GEMMs and of what it saves: a fusion over a linear layer
nests a GEMM record in its own args and saves a :class:`LinearSaved`, so a missing field
is an error where the record is built, in every precision."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.functional.parallel import TensorParallel
from fusible.quantization.tensor.float8_tensor import Fp8Able
from fusible.quantization.format import Float8Format

# Declared for fusion authors (docs/writing_a_fusion.md, "Helpers for fusion authors").
__all__ = ["GemmBackwardArgs", "GemmForwardArgs", "LinearSaved"]

Tensor = torch.Tensor


@attrs.define
class GemmForwardArgs:
    """A linear layer's forward GEMM, ``y = x @ weight.T``.

    Attributes
    ----------
    input : Tensor or Float8Tensor
        ``x`` (a Float8Tensor when the stage before handed it over quantized).
    weight : Tensor or Float8Tensor
        The (local shard of the) weight parameter; a Float8Tensor for an FP8 parameter
        (``quantized_model_init``), which FP8 GEMMs read as it is.
    input_format, weight_format : Float8Format or None
        The FP8 formats of the GEMM's operands; None for a high-precision GEMM.
        ``input_format.columnwise``: keep the input's transposed copy for wgrad.
    parallel : TensorParallel
        How the layer is split over a process group (the layer's ``parallel``).
    """

    input: Fp8Able
    weight: Fp8Able  # a Float8Tensor for an FP8 parameter (quantized_model_init)
    input_format: Optional[Float8Format]
    weight_format: Optional[Float8Format]
    parallel: TensorParallel

    @property
    def fp8(self) -> bool:
        return self.input_format is not None


@attrs.define
class GemmBackwardArgs:
    """A linear layer's backward GEMMs: dgrad ``dy @ weight`` and wgrad ``dy.T @ x``.

    Attributes
    ----------
    grad_output : Tensor or Float8Tensor
        ``dy``.
    input, weight : Tensor, Float8Tensor or None
        As saved (:class:`LinearSaved`). None where the gradient that reads it is not
        needed. Under FP8 a high-precision weight is quantized by :func:`gemm_backward`
        itself, into the transposed copy dgrad reads, and dropped before the wgrad GEMM:
        the FP8 copy and the weight gradient are never alive together (the 70B FFN's W13
        at 2048 tokens: 0.44 GiB of peak).
    grad_format : Float8Format or None
        The FP8 format of ``dy``; None for high-precision GEMMs.
    need_grad_input, need_grad_weight : bool
        Which of dgrad and wgrad to compute.
    parallel : TensorParallel
    weight_format : Float8Format or None
        Under FP8, the format to quantize a high-precision weight to.
    weight_amax : Tensor or None
        The forward's absolute maximum of the weight (the same scale, bits and no second
        amax pass); None: computed.
    wgrad_dtype : torch.dtype or None
        The dtype of the weight gradient (float32 where it goes into ``main_grad``);
        None: ``dy``'s.
    """

    grad_output: Fp8Able
    input: Optional[Fp8Able]
    weight: Optional[Fp8Able]
    grad_format: Optional[Float8Format]
    need_grad_input: bool
    need_grad_weight: bool
    parallel: TensorParallel
    weight_format: Optional[Float8Format] = None
    weight_amax: Optional[Tensor] = None
    wgrad_dtype: Optional[torch.dtype] = None


@attrs.define
class LinearSaved:
    """BasicLinear's saved record (:func:`~fusible.functional.linear_state.save_linear`
    writes it, :func:`~fusible.functional.linear_state.gemm_backward_args` reads it).

    Attributes
    ----------
    input : Tensor, Float8Tensor or None
        The input, for wgrad (under FP8 its transposed copy only); None where the weight
        needs no gradient.
    weight : Tensor or None
        The weight parameter itself, for dgrad; None where the input needs no gradient.
    weight_amax : Tensor or None
        Under FP8, the forward's absolute maximum of the weight, reused by the backward.
    """

    input: Optional[Fp8Able]
    weight: Optional[Tensor]
    weight_amax: Optional[Tensor] = None  # under FP8: the forward's, reused by the backward
