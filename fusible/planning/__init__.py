"""Planning: the fusion registry, the planner's scan, the passes over a planned group
(gradient needs, sequence-parallel checks, FP8 hand-off), plan data and diagrams."""

from fusible.planning.plan import FusionPlan
from fusible.planning.planner import Candidate, GroupPlan, PlanEnvironment, Stage
from fusible.planning.exec_plan import ExecPlan, ExecStage
from fusible.planning.prepare import prepare_group
from fusible.planning.registry import register_fusion, registered_fusions, unregister_fusion

__all__ = ["Candidate", "ExecPlan", "ExecStage", "FusionPlan", "GroupPlan", "PlanEnvironment",
           "Stage", "prepare_group", "register_fusion", "registered_fusions", "unregister_fusion"]
