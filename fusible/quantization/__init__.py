"""FP8: recipes, autocast, formats, the Float8Tensor and its casts."""

from fusible.quantization.autograd import quantize
from fusible.quantization.block_recipes import Float8BlockScaling, MXFP8BlockScaling
from fusible.quantization.boundary import decode_results, encode_results
from fusible.quantization.delayed import DelayedScaling
from fusible.quantization.float8_tensor import Float8Tensor, Fp8Able
from fusible.quantization.format import Float8Format, to_format
from fusible.quantization.params import fp8_parameter, quantized_model_init
from fusible.quantization.recipe import (Float8CurrentScaling, Float8RowwiseScaling, autocast,
                                         fp8_recipe)
from fusible.quantization.recipe_base import (Recipe, recipe_from_name, register_recipe,
                                              registered_recipes, unregister_recipe)

__all__ = ["DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling", "Float8Format",
           "Float8RowwiseScaling", "Float8Tensor", "Fp8Able", "MXFP8BlockScaling", "Recipe",
           "autocast", "decode_results", "encode_results", "fp8_parameter", "fp8_recipe",
           "quantize", "quantized_model_init", "recipe_from_name", "register_recipe",
           "registered_recipes", "to_format", "unregister_recipe"]
