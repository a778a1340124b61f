"""Current-scaling recipes: each tensor scaled by its own amax when it is cast, one scale
per tensor (``tensorwise``) or per row (``rowwise``)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from fusible.quantization.recipes.granularity import GranularityRecipe, check_fp8_format


@attrs.frozen
class Float8CurrentScaling(GranularityRecipe):
    """Per-tensor current scaling: each tensor is scaled by its own amax when it is cast
    (registered as ``"tensorwise"``; presets ``"tensorwise"`` and ``"tensorwise_e4m3"``).

    Attributes
    ----------
    fp8_format : {"hybrid", "e4m3"}
        ``"hybrid"``: E4M3 for forward tensors (inputs, weights), E5M2 for
        gradients (more range). ``"e4m3"``: E4M3 for both.

    Examples
    --------
    >>> with fusible.autocast(recipe=fusible.Float8CurrentScaling()):
    ...     y = model(x)
    """

    name: ClassVar[str] = "tensorwise"
    presets: ClassVar[dict] = {"tensorwise": {}, "tensorwise_e4m3": {"fp8_format": "e4m3"}}
    granularity: ClassVar[str] = "tensorwise"


@attrs.frozen
class Float8RowwiseScaling(GranularityRecipe):
    """Row-wise current scaling: one scale per row of each GEMM operand (a token of the
    input and of the gradient, an output feature of the weight), and the transposed
    copies the backward GEMMs read scaled per row of their own layout (an input feature
    of the weight, a feature of the input and of the gradient), as the math requires.
    More accurate than one scale per tensor where rows differ in magnitude (outliers);
    ``torch._scaled_mm`` with row-wise scales on the GPU. Registered as ``"rowwise"``
    (presets ``"rowwise"``, E4M3 throughout as torchao's, and ``"rowwise_hybrid"``).

    Tensor parallelism gathers the tokens in FP8 with their scales (each rank casts its
    own; the transposed copy's per-feature scales from the group's maxima). Not yet: FP8
    parameters (``quantized_model_init``), the producers' fused casts (norms and
    activations hand over high precision; the cast follows them in their stage).

    Parameters
    ----------
    fp8_format : {"e4m3", "hybrid"}
        ``"e4m3"``: E4M3 for every operand; ``"hybrid"``: E5M2 for gradients.
    """

    name: ClassVar[str] = "rowwise"
    presets: ClassVar[dict] = {"rowwise": {}, "rowwise_hybrid": {"fp8_format": "hybrid"}}
    granularity: ClassVar[str] = "rowwise"

    fp8_format: str = attrs.field(default="e4m3", validator=check_fp8_format)
