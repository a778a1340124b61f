"""FP8: recipes, autocast, formats, the Float8Tensor and its casts.

``recipes/`` (the Recipe base and registry, the built-in recipes, autocast), ``scalings/``
(what one scale covers: the plugin point behind a format's granularity), ``casts/`` (one
cast entry point per granularity), ``tensor/`` (Float8Tensor, its op table, the quantize
functions), ``format.py`` (Float8Format), ``gemm.py`` (FP8 GEMMs), ``params.py`` (FP8
parameters), ``fsdp_weight.py`` (FP8 all-gathers under FSDP2).
"""

from fusible.quantization.format import Float8Format, to_format
from fusible.quantization.gemm_policy import Fp8GemmPolicy
from fusible.quantization.params import fp8_parameter, quantized_model_init
from fusible.quantization.recipes.autocast import autocast, fp8_recipe
from fusible.quantization.recipes.base import (Recipe, recipe_from_name, register_recipe,
                                               registered_recipes, unregister_recipe)
from fusible.quantization.recipes.blocks import Float8BlockScaling, MXFP8BlockScaling
from fusible.quantization.recipes.current import Float8CurrentScaling, Float8RowwiseScaling
from fusible.quantization.recipes.delayed import DelayedScaling
from fusible.quantization.tensor.autograd import quantize
from fusible.quantization.tensor.boundary import decode_results, encode_results
from fusible.quantization.tensor.float8_tensor import Float8Tensor, Fp8Able

__all__ = ["Fp8GemmPolicy", "DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling", "Float8Format",
           "Float8RowwiseScaling", "Float8Tensor", "Fp8Able", "MXFP8BlockScaling", "Recipe",
           "autocast", "decode_results", "encode_results", "fp8_parameter", "fp8_recipe",
           "quantize", "quantized_model_init", "recipe_from_name", "register_recipe",
           "registered_recipes", "to_format", "unregister_recipe"]
