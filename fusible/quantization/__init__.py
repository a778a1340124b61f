"""FP8: recipes, autocast, the Float8Tensor and its casts."""

from fusible.quantization.autograd import quantize
from fusible.quantization.float8_tensor import Float8Tensor
from fusible.quantization.recipe import Float8CurrentScaling, autocast, fp8_recipe

__all__ = ["Float8CurrentScaling", "Float8Tensor", "autocast", "fp8_recipe", "quantize"]
