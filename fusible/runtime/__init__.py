"""The runtime: the executor (one autograd.Function per group of basic ops), plan caches
per group, the stages' custom ops, the compiled path and the compile report."""

from fusible.runtime.captured_step import CapturedStep, UncapturableError, capture_step
from fusible.runtime.compiled import compiled_forward
from fusible.runtime.cuda_graphs import make_graphed_callables
from fusible.runtime.layout import Layout
from fusible.runtime.report import CompileReport, compile_report
from fusible.runtime.runner import PipelineRunner

__all__ = ["CapturedStep", "CompileReport", "Layout", "PipelineRunner", "UncapturableError",
           "capture_step", "compile_report", "compiled_forward", "make_graphed_callables"]
