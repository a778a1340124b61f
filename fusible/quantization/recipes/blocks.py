"""Block-scaled recipes: DeepSeek-V3's blockwise scaling and MXFP8, each a recipe class
over the block scalings of :mod:`fusible.quantization.scalings.block` (registered as
entry points of ``fusible.recipes``, like every recipe)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from fusible.quantization.recipes.granularity import GranularityRecipe, check_fp8_format


@attrs.frozen
class Float8BlockScaling(GranularityRecipe):
    """Blockwise current scaling as DeepSeek-V3 trained with it: one scale per 1x128 tile
    of each row of the activations and gradients (their transposed copies tiled along
    their own rows, 128 tokens), one per 128x128 block of the weights (the transposed
    copy shares them), E4M3 throughout. PyTorch's blockwise GEMM (cuBLAS) on Hopper with
    CUDA 12.9 or later; emulated elsewhere (the operands dequantized, a float32 GEMM;
    plans and compile reports say so). Registered as ``"blockwise"``.

    Tensor parallelism gathers the tokens in FP8 with their tile scales where every rank
    holds whole 128-token tiles (the transposed copy's tiles run along the tokens). Not
    yet: FP8 parameters (``quantized_model_init``), the producers' fused casts (norms and
    activations hand over high precision; the cast follows them in their stage).
    """

    name: ClassVar[str] = "blockwise"
    presets: ClassVar[dict] = {"blockwise": {}}
    granularity: ClassVar[str] = "blockwise_1x128"
    weight_granularity: ClassVar[str] = "blockwise_128x128"

    fp8_format: str = attrs.field(default="e4m3", init=False)


@attrs.frozen
class MXFP8BlockScaling(GranularityRecipe):
    """MXFP8: E4M3 data with one power-of-two (E8M0) scale per 32 consecutive values of a
    row, for every operand, the transposed copies scaled along their own rows (OCP MX;
    the scale rounded up, so that no value saturates). Its GEMMs are emulated on every
    device for now (the operands dequantized, a float32 GEMM; plans and compile reports
    say so): fusible has no path to Blackwell's native MX GEMM yet. Registered as
    ``"mxfp8"``.

    Parameters
    ----------
    fp8_format : {"e4m3", "hybrid"}
        ``"e4m3"``: E4M3 for every operand; ``"hybrid"``: E5M2 for gradients.
    """

    name: ClassVar[str] = "mxfp8"
    presets: ClassVar[dict] = {"mxfp8": {}, "mxfp8_hybrid": {"fp8_format": "hybrid"}}
    granularity: ClassVar[str] = "mx_1x32"

    fp8_format: str = attrs.field(default="e4m3", validator=check_fp8_format)
