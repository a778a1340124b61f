"""The bottom layer: the operation contract, per-call state, plan conditions, the pattern
DSL and how arguments cross custom ops. It imports nothing else of fusible."""

from fusible.core.conditions import PlanConditions
from fusible.core.context import OperationContext
from fusible.core.example import Example
from fusible.core.fused import FusedOperation
from fusible.core.operation import BasicOperationSpec, FusibleSpec
from fusible.core.pattern import AnyOf, Check, Match, Op, Pattern
from fusible.core.results import BackwardResult, ForwardResult, OpGradNeeds
from fusible.core.schema import SchemaType, register_schema_type
from fusible.core.stage import StageSpec

__all__ = ["AnyOf", "BackwardResult", "BasicOperationSpec", "Check", "Example",
           "ForwardResult", "FusedOperation", "FusibleSpec", "Match", "Op", "OpGradNeeds",
           "OperationContext", "Pattern", "PlanConditions", "SchemaType", "StageSpec",
           "register_schema_type"]
