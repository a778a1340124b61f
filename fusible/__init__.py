"""fusible: fast PyTorch training through operation fusion.

Build models as :class:`fusible.ops.Sequential` pipelines of fusible
operations; a fusion planner fuses patterns such as Linear+Bias in the forward
and, independently, in the backward. ``model.plan()`` shows what it decided.
"""

from fusible import ops, testing
from fusible.ops.base import FusedOperation, OperationContext
from fusible.pattern import Check, Op, Pattern
from fusible.plan import FusionPlan
from fusible.planner import Candidate, PlanEnvironment, Stage
from fusible.registry import register_fusion, registered_fusions, unregister_fusion
from fusible.convert import state_dict_from_torch
from fusible.report import CompileReport, compile_report
from fusible.quantization import Float8CurrentScaling, Float8Tensor, autocast, quantize

__version__ = "0.1.0"

__all__ = [
    "Candidate", "Check", "CompileReport", "Float8CurrentScaling", "Float8Tensor", "autocast",
    "quantize", "FusedOperation", "FusionPlan", "Op",
    "OperationContext", "Pattern", "PlanEnvironment", "Stage", "compile_report", "ops",
    "register_fusion", "registered_fusions", "state_dict_from_torch", "testing",
    "unregister_fusion",
]

# The built-in fusions register themselves exactly as a plugin would; importing
# them last keeps registration order (= tie-break priority) fixed.
import fusions  # noqa: E402,F401
