"""compile_report: what torch.compile made of a function that runs fusible models."""

from __future__ import annotations

import collections
from typing import Any, Callable

import attrs
import torch

from fusible.core.schema import record_fields
from fusible.functional.linear_records import GemmBackwardArgs, GemmForwardArgs
from fusible.runtime.custom_ops import stage_op_named


@attrs.frozen
class OpCall:
    """A fusible custom op in a compiled graph.

    Attributes
    ----------
    op : str
        The custom op, e.g. ``"fusible::ForwardLinearBias_fwd"``.
    provenance : str
        The stage it runs: fusion or op name, pipeline indices, the basic ops.
    gemm : str
        ``"fp8 <granularity>"`` (``"fp8 tensorwise"``, ...; ``" (emulated)"`` added where
        the device has no native GEMM for that scaling) or ``"high precision"`` for a
        stage with a linear layer's GEMMs (read from the formats in its GEMM records),
        else ``""``.
    """

    op: str
    provenance: str
    gemm: str = ""


@attrs.frozen
class GraphReport:
    """One compiled graph: ``kind`` is "forward", "backward" or "inference"."""

    kind: str
    frame: str
    fusible_ops: tuple
    other_ops: tuple


@attrs.frozen
class CompileReport:
    """What :func:`compile_report` saw.

    Attributes
    ----------
    graph_breaks : tuple of str
        The reasons of the graph breaks, each once.
    graphs : tuple of GraphReport
        Every AOTAutograd graph, in compilation order.
    recompilations : int
        Compilations of a frame that had been compiled before in this run.
    """

    graph_breaks: tuple
    graphs: tuple
    recompilations: int

    @property
    def forward_graphs(self) -> tuple:
        return tuple(g for g in self.graphs if g.kind in ("forward", "inference"))

    @property
    def backward_graphs(self) -> tuple:
        return tuple(g for g in self.graphs if g.kind == "backward")

    def __str__(self) -> str:
        lines = [f"compile report: {len(self.graph_breaks)} graph break(s), "
                 f"{len(self.graphs)} graph(s), {self.recompilations} recompilation(s)"]
        lines += [f"  graph break: {reason}" for reason in self.graph_breaks]
        for g in self.graphs:
            lines.append(f"  {g.kind} graph (frame {g.frame}): {len(g.fusible_ops)} fusible op(s)")
            lines += [f"    {c.op:<42} {(c.gemm + ' GEMM') if c.gemm else '':<36} {c.provenance}"
                      for c in g.fusible_ops]
            if g.other_ops:
                other = collections.Counter(g.other_ops)
                lines.append("    other ops: " + ", ".join(f"{k} x{n}" for k, n in other.items()))
        return "\n".join(lines)


_IGNORED = {"getitem", "<built-in function getitem>"}


def _graph_report(kind: str, frame: str, gm: torch.fx.GraphModule) -> GraphReport:
    fusible, other = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name.startswith("fusible."):
            op = stage_op_named(name.split(".")[1])
            values = op.expand(node.args) if op is not None else None
            # an op that is no stage (an FP8 cast between stages) has no provenance
            fusible.append(OpCall("fusible::" + name.split(".")[1],
                                  str(values[-1]) if values else "",
                                  _gemm_precision(op, values, _device_of(node))))
        elif name not in _IGNORED:
            other.append(name)
    return GraphReport(kind, frame, tuple(fusible), tuple(other))


def _device_of(node):
    """The device of the first tensor argument of an FX node (its fake value), or None."""
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return None


def _gemm_precision(op, values, device=None) -> str:
    """From a stage op's values: its GEMMs' precision, read from the formats of the
    linear-layer GEMM records among its args (found by type; only the formats, which are
    constants in the graph, are read): ``"fp8 <granularity>"``, ``" (emulated)"`` where
    ``device`` has no native GEMM for it."""
    if op is None:
        return ""
    return " + ".join(sorted(set(_gemm_precisions(op.args_type, op.fields, values, device))))


_GEMM_FORMATS = {GemmForwardArgs: "input_format", GemmBackwardArgs: "grad_format"}


def _gemm_precisions(record_type, fields, flat, device=None) -> list:
    """``"fp8 <granularity>"`` or ``"high precision"`` per GEMM record in
    ``record_type``'s flat args."""
    out, pos = [], 0
    for name, st in fields:
        n = len(st.parts)
        if name == _GEMM_FORMATS.get(record_type):
            fmt = st.unflatten(flat[pos:pos + n])
            out.append("high precision" if fmt is None else _fp8_precision(fmt, device))
        elif st.record_type is not None:
            out += _gemm_precisions(st.record_type, record_fields(st.record_type),
                                    flat[pos:pos + n], device)
        pos += n
    return out


def _fp8_precision(fmt, device) -> str:
    emulated = device is not None and fmt.scaling.emulated_on(device)
    return f"fp8 {fmt.granularity}" + (" (emulated)" if emulated else "")


def compile_report(fn: Callable, *args: Any, **kwargs: Any) -> CompileReport:
    """Compile ``fn`` (without ``fullgraph``), run it once, and report what was compiled.

    When grad is enabled and ``fn`` returns tensors that require grad (alone or
    in a tuple or list), the report then runs their backward (with gradients of
    ones), outside the compiled region, so that the backward graphs are
    compiled and reported too. A ``.backward()`` inside ``fn`` would itself be a
    graph break.

    Parameters
    ----------
    fn : callable
        For example ``model`` or ``lambda x: model(x, x)``.
    *args, **kwargs
        Passed to ``fn``.

    Returns
    -------
    CompileReport
        Graph breaks with their reasons; each forward, backward or inference graph
        with its fusible custom ops in order and where each comes from (the stage
        and the ops it covers); the number of recompilations.
    """
    # Imported here, not with the module: they pull in torch._dynamo (0.4 s), which
    # `import fusible` need not pay; a report compiles anyway.
    from functorch.compile import make_boxed_func
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs, recompiles, frames_seen = [], [0], set()

    def backend(gm, example_inputs):
        compile_id = torch._guards.CompileContext.current_compile_id()
        frame = str(compile_id) if compile_id is not None else "?"
        if compile_id is not None:
            recompiles[0] += compile_id.frame_id in frames_seen
            frames_seen.add(compile_id.frame_id)

        def capture(kind):
            @torch.compiler.disable  # runs lazily, maybe inside fn: not something to trace
            def compiler(graph, inputs):
                graphs.append(_graph_report(kind, frame, graph))
                return make_boxed_func(graph.forward)
            return compiler

        return aot_module_simplified(gm, example_inputs, fw_compiler=capture("forward"),
                                     bw_compiler=capture("backward"),
                                     inference_compiler=capture("inference"))

    before = collections.Counter(counters["graph_break"])
    out = torch.compile(fn, backend=backend)(*args, **kwargs)
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    breaks = collections.Counter(counters["graph_break"]) - before
    # Dynamo may meet one break several times (retracing); the call of fusible's eager
    # fallback follows a fusible break that already says why.
    reasons = tuple(r for r in breaks if "_run_eagerly" not in r)
    return CompileReport(reasons, tuple(graphs), recompiles[0])
