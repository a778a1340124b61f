"""fusible: fast PyTorch training through operation fusion.

Build models as :class:`fusible.ops.Sequential` pipelines of fusible
operations; a fusion planner fuses patterns such as Linear+Bias in the forward
and, independently, in the backward. ``model.plan()`` shows what it decided.

This module is the top of the package: it gathers the public names of the layers
below it (see docs/design.md) and is imported by none of them. The built-in fusions
(``fusible.fusions``) load at the first planning, like plugins.
"""

from fusible import layers, ops, testing
from fusible.fsdp import fsdp_float8_all_gather
from fusible.models.conversion import ConversionReport, convert, convert_module
from fusible.models.glu_rows import deinterleave_glu_rows, interleave_glu_rows
from fusible.models.layer_converter import (LayerConverter, register_layer_converter,
                                            registered_layer_converters,
                                            unregister_layer_converter)
from fusible.models.model_plan import ModelPlan, plan_model
from fusible.models.state_dicts import state_dict_from_torch, state_dict_to_torch
from fusible.pipelining import pipeline_stage
from fusible.core import (Check, Example, FusedOperation, Op, OperationContext, Pattern,
                          PlanConditions, register_schema_type)
from fusible.planning import (Candidate, FusionPlan, PlanEnvironment, Stage, register_fusion,
                              registered_fusions, unregister_fusion)
from fusible.quantization import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                  Float8Format, Float8RowwiseScaling, Float8Tensor,
                                  Fp8GemmPolicy,
                                  MXFP8BlockScaling, Recipe,
                                  autocast, quantize, quantized_model_init, recipe_from_name,
                                  register_recipe, registered_recipes, unregister_recipe)
from fusible.runtime import (CapturedStep, CompileReport, UncapturableError, capture_step,
                             compile_report, make_graphed_callables)
from fusible.core.lanes import split_backward
from fusible.runtime.recompute import checkpoint, checkpoint_context
from fusible.runtime.wgrad import pending as pending_wgrad
from fusible.runtime.wgrad import run_pending as run_deferred_wgrad
from fusible.runtime.wgrad import take as take_deferred_wgrad

__version__ = "0.2.0"

__all__ = [
    "autocast", "Candidate", "capture_step", "CapturedStep", "Check", "checkpoint", "checkpoint_context", "compile_report",
    "CompileReport", "ConversionReport", "convert", "convert_module", "deinterleave_glu_rows",
    "DelayedScaling", "Example", "Float8BlockScaling", "Float8CurrentScaling", "Float8Format",
    "Float8RowwiseScaling", "Float8Tensor", "Fp8GemmPolicy", "fsdp_float8_all_gather", "FusedOperation",
    "FusionPlan", "interleave_glu_rows", "LayerConverter", "layers", "make_graphed_callables",
    "ModelPlan", "MXFP8BlockScaling", "Op", "OperationContext", "ops", "Pattern",
    "pending_wgrad", "pipeline_stage", "plan_model", "PlanConditions", "PlanEnvironment",
    "quantize", "quantized_model_init", "Recipe", "recipe_from_name", "register_fusion",
    "register_layer_converter", "register_recipe", "register_schema_type",
    "registered_fusions", "registered_layer_converters", "registered_recipes",
    "run_deferred_wgrad", "split_backward", "Stage", "state_dict_from_torch",
    "state_dict_to_torch", "take_deferred_wgrad", "testing", "unregister_fusion",
    "unregister_layer_converter", "unregister_recipe", "UncapturableError"]
