"""fusible: fast PyTorch training through operation fusion.

Build models as :class:`fusible.ops.Sequential` pipelines of fusible
operations; a fusion planner fuses patterns such as Linear+Bias in the forward
and, independently, in the backward. ``model.plan()`` shows what it decided.

This module is the top of the package: it gathers the public names of the layers
below it (see docs/design.md) and is imported by none of them. The built-in fusions
(``fusible.fusions``) load at the first planning, like plugins.
"""

from fusible import ops, testing
from fusible.convert import (deinterleave_glu_rows, interleave_glu_rows,
                             state_dict_from_torch)
from fusible.fsdp import fsdp_float8_all_gather
from fusible.model_plan import ModelPlan, plan_model
from fusible.pipelining import pipeline_stage
from fusible.core import (Check, Example, FusedOperation, Op, OperationContext, Pattern,
                          PlanConditions, register_schema_type)
from fusible.planning import (Candidate, FusionPlan, PlanEnvironment, Stage, register_fusion,
                              registered_fusions, unregister_fusion)
from fusible.quantization import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                  Float8Format, Float8RowwiseScaling, Float8Tensor,
                                  MXFP8BlockScaling, Recipe,
                                  autocast, quantize, quantized_model_init, recipe_from_name,
                                  register_recipe, registered_recipes, unregister_recipe)
from fusible.runtime import CompileReport, compile_report, make_graphed_callables
from fusible.core.lanes import split_backward
from fusible.runtime.wgrad import pending as pending_wgrad
from fusible.runtime.wgrad import run_pending as run_deferred_wgrad
from fusible.runtime.wgrad import take as take_deferred_wgrad

__version__ = "0.1.0"

__all__ = [
    "Candidate", "Check", "CompileReport", "DelayedScaling", "Example", "Float8BlockScaling",
    "Float8CurrentScaling", "Float8Format", "Float8RowwiseScaling", "Float8Tensor",
    "FusedOperation", "FusionPlan", "MXFP8BlockScaling", "Op", "OperationContext", "Pattern",
    "PlanConditions", "PlanEnvironment", "Recipe", "Stage", "autocast", "compile_report",
    "deinterleave_glu_rows", "fsdp_float8_all_gather", "interleave_glu_rows",
    "ModelPlan", "make_graphed_callables", "ops", "plan_model", "pending_wgrad", "pipeline_stage", "quantize",
    "quantized_model_init", "recipe_from_name", "run_deferred_wgrad", "split_backward",
    "take_deferred_wgrad",
    "register_fusion", "register_recipe", "register_schema_type", "registered_fusions",
    "registered_recipes", "state_dict_from_torch", "testing", "unregister_fusion",
    "unregister_recipe",
]
