"""Rewriting a converted module's Python forward in place: its ``x + linear(y)`` adds
fused into the linear layer's pipeline.

:func:`fuse_residual_adds` traces a module's forward one level deep with ``torch.fx``
(every submodule a leaf), finds adds of a residual and the output of a fusible child that
ends in a linear layer, and makes that child a Sequential ending in ``AddExtraInput``,
called as ``child(y, residual)``. The rewritten forward, the trace's code, is installed
on the instance (:class:`TracedForward`): the module keeps its class, attributes and
methods. Where the residual cannot be the extra input at run time (another shape, which
the add would broadcast; another dtype, which it would promote, as under
``torch.autocast``), :func:`residual_add` computes the add as written instead.
"""

from __future__ import annotations

import ast
import collections
import inspect
import operator
import textwrap
import types
from typing import Any, Optional, cast

import attrs
import torch
from torch import fx, nn

from fusible.core import tokens
from fusible.models.checkpoint_names import CheckpointNames
from fusible.models.traced_forward import TracedForward
from fusible.module import PipelineModule, Sequential
from fusible.ops.add_extra_input import AddExtraInput
from fusible.ops.basic_linear import BasicLinear, parallel_refusal
from fusible.ops.bias import Bias
from fusible.ops.linear import Linear
from fusible.runtime.layout import without_layout
from fusible.ops.make_extra_output import MakeExtraOutput

Tensor = torch.Tensor

FUSED = "Linear + residual"
_ADDS = {("call_function", operator.add), ("call_function", torch.add),
         ("call_method", "add")}  # torch.add(a, b, alpha=...) has kwargs: not matched
_MODULE_STATE = frozenset(nn.Module().__dict__)  # training, _parameters, the hook dicts...


@attrs.frozen
class ResidualFusion:
    """What :func:`fuse_residual_adds` did to one module: the children whose residual
    adds it fused, the adds it left with why, or why it could not trace the forward."""

    fused: tuple = ()       # child names
    unfused: tuple = ()     # (child name, why)
    untraced: Optional[str] = None


@attrs.frozen
class _Match:
    add: fx.Node
    linear: fx.Node         # the child's call_module node
    residual: Any           # the other operand
    residual_first: bool    # ``residual + child(y)`` rather than ``child(y) + residual``


class _ChildrenAsLeaves(fx.Tracer):
    """Traces one level deep: no submodule's forward is traced."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _adds_a_child(forward, children: set) -> bool:
    """Whether a forward's own code adds (``+``, ``+=``, ``.add(``, ``torch.add``) a value
    computed from one of ``children`` (``self.<child>(...)``, directly or through a local
    name assigned from such a call on an earlier line): the one-level trace fuses only
    such adds, so a forward without one (a causal-LM head's, a model's that adds position
    embeddings or sequence lengths) has none to fuse. True where the source cannot be
    read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(forward))))
    except (OSError, TypeError, SyntaxError):
        return True
    derived: dict = {}  # local name -> first line assigning it a child's output (or from one)

    def from_child(node, line: int) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and \
                    isinstance(sub.func.value, ast.Name) and sub.func.value.id == "self" and \
                    sub.func.attr in children:
                return True
            if isinstance(sub, ast.Name) and derived.get(sub.id, line) < line:
                return True
        return False

    statements = sorted((n for n in ast.walk(tree) if isinstance(n, ast.stmt)),
                        key=lambda n: n.lineno)
    for statement in statements:  # in source order: a name is a child's output after it is
        value = getattr(statement, "value", None)
        if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and \
                value is not None and from_child(value, statement.lineno + 1):
            targets = statement.targets if isinstance(statement, ast.Assign) \
                else [statement.target]
            for name in (n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                derived.setdefault(name, statement.lineno)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and \
                from_child(node, line):
            return True
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and \
                (from_child(node.value, line) or from_child(node.target, line)):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("add", "add_") and from_child(node, line):
            return True
    return False


def fuse_residual_adds(module: nn.Module, path: str, shared: frozenset) -> ResidualFusion:
    """Fuse the ``residual + child(y)`` adds of ``module``'s forward into its children,
    installing the rewritten forward (see the module docstring).

    Parameters
    ----------
    module : nn.Module
        Its children already converted; changed in place where an add fuses.
    path : str
        Its name in the model, for error messages at run time.
    shared : frozenset
        ``id()`` of the modules that appear more than once in the model: never rewritten.

    Returns
    -------
    ResidualFusion
    """
    fusible = {n for n, c in module.named_children() if isinstance(c, PipelineModule)}
    if not fusible or "forward" in module.__dict__:  # nothing to fuse; or patched already
        return ResidualFusion()
    if not _adds_a_child(type(module).forward, fusible):
        return ResidualFusion()  # no add of a child's output: nothing to trace for
    try:
        graphs, reads = _trace_both_modes(module)
    except Exception as e:  # noqa: BLE001 - fx's errors vary (TraceError, TypeError, ...)
        return ResidualFusion(untraced=_short(e))
    matches = {mode: _matches(g, fusible) for mode, g in graphs.items()}
    unfused = _refusals(module, graphs, matches, shared)
    found = {m.linear.target: None for ms in matches.values() for m in ms}  # forward order
    chosen = [name for name in found if name not in unfused]
    if not chosen:
        return ResidualFusion(unfused=tuple(unfused.items()))
    out_features = {name: cast(BasicLinear, _final_linear(getattr(module, name))).out_features
                    for name in chosen}  # refused where there is none
    for mode, graph in graphs.items():
        _rewrite(graph, [m for m in matches[mode] if m.linear.target in chosen], path,
                 out_features)
    for name in chosen:
        setattr(module, name, _with_residual_add(getattr(module, name)))
    module.forward = TracedForward(module, graphs, reads)
    return ResidualFusion(tuple(chosen), tuple(unfused.items()))


def _short(error: Exception, limit: int = 160) -> str:
    text = " ".join(str(error).split())
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


def _trace_both_modes(module: nn.Module) -> tuple:
    """The forward's graph in training and in evaluation (a forward that reads
    ``self.training`` traces into two), and the plain attributes the traces read, whose
    values the graphs hold as constants."""
    graphs: dict[Optional[bool], fx.Graph] = {}
    reads: dict[str, Any] = {}
    mode = module.training
    try:
        for training in (True, False):
            module.training = training
            graphs[training], read = _trace_recording_reads(module)
            reads.update(read)
    finally:
        module.training = mode
    if graphs[True].python_code("self").src == graphs[False].python_code("self").src:
        graphs = {None: graphs[True]}  # one graph for both modes
    return graphs, reads


def _trace_recording_reads(module: nn.Module) -> tuple:
    """``(graph, {name: value})``: the trace, and the instance attributes it read."""
    cls, reads = type(module), cast(dict[str, Any], {})

    def getattribute(self, name):
        value = cls.__getattribute__(self, name)
        if (self is module and name not in _MODULE_STATE
                and name in object.__getattribute__(self, "__dict__")):
            reads.setdefault(name, value)
        return value

    module.__class__ = types.new_class(cls.__name__, (cls,), exec_body=lambda ns: ns.update(
        __getattribute__=getattribute, __module__=cls.__module__))
    try:
        return _ChildrenAsLeaves().trace(module), reads
    finally:
        module.__class__ = cls


def _matches(graph: fx.Graph, fusible: set) -> list:
    """The adds of one fusible child's output, used by the add alone, and another value."""
    found = []
    for node in graph.nodes:
        if (node.op, node.target) not in _ADDS or node.kwargs or len(node.args) != 2:
            continue
        left, right = node.args
        for linear, residual, first in ((right, left, True), (left, right, False)):
            if _called_child(linear, fusible) and isinstance(residual, fx.Node) \
                    and residual is not linear:
                found.append(_Match(node, linear, residual, first))
                break
    return found


def _called_child(node: Any, fusible: set) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_module" and node.target in fusible
            and len(node.args) == 1 and not node.kwargs)


def _refusals(module: nn.Module, graphs: dict, matches: dict, shared: frozenset) -> dict:
    """``{child name: why its add stays}`` for the children found in an add."""
    names = {m.linear.target for ms in matches.values() for m in ms}
    why: dict[str, str] = {}
    for mode, graph in graphs.items():
        order = {node: i for i, node in enumerate(graph.nodes)}
        for m in matches[mode]:
            name = m.linear.target
            reason = (_refusal(getattr(module, name), shared) or _use_refusal(graph, name, m)
                      or ("the residual is computed after it; fusing would reorder them"
                          if order[m.residual] > order[m.linear] else None))
            if reason:
                why.setdefault(name, f"x + {name}(...) stays unfused: {reason}")
        for name in names - set(why):
            if _calls(graph, name) > sum(m.linear.target == name for m in matches[mode]):
                why[name] = f"x + {name}(...) stays unfused: {name} is also called without it"
    return why


def _refusal(child: PipelineModule, shared: frozenset) -> Optional[str]:
    """Why ``child`` cannot take the residual add at its end (None: it can)."""
    if id(child) in shared:
        return f"{type(child).__name__} is shared with another module"
    items = child.pipeline()
    if any(isinstance(op, (AddExtraInput, MakeExtraOutput)) for op in items):
        return "it has extra inputs or outputs already"
    linear = _final_linear(child)
    if linear is None:
        return f"it ends in {type(items[-1]).__name__}, not a linear layer"
    accepted = parallel_refusal(linear)
    return None if accepted is True else str(accepted)


def _use_refusal(graph: fx.Graph, name: str, match: _Match) -> Optional[str]:
    if len(match.linear.users) != 1:
        return "its output has other uses"
    if any(n.op in ("get_attr", "call_module") and n.target.startswith(name + ".")
           or n.op == "get_attr" and n.target == name for n in graph.nodes):
        return "the forward reaches into it"
    return None


def _calls(graph: fx.Graph, name: str) -> int:
    return sum(n.op == "call_module" and n.target == name for n in graph.nodes)


def _final_linear(child: PipelineModule) -> Optional[BasicLinear]:
    """The BasicLinear the pipeline of ``child`` ends in (after its Bias), or None."""
    items = list(child.pipeline())
    if items and isinstance(items[-1], Bias):
        items.pop()
    return items[-1] if items and isinstance(items[-1], BasicLinear) else None


# Rewriting ---------------------------------------------------------------------------

def _rewrite(graph: fx.Graph, matches: list, path: str, out_features: dict) -> None:
    """Each matched add becomes one ``residual_add(child, y, residual, ...)`` call, where
    the child's call was (the residual is computed before it: the order stays)."""
    replaced: dict = {}  # add node -> its fused call, where a residual is an earlier add
    for m in matches:
        name = m.linear.target
        with graph.inserting_before(m.linear):
            child = graph.get_attr(name)
            fused = graph.call_function(residual_add, (
                child, m.linear.args[0], replaced.get(m.residual, m.residual),
                out_features[name], m.residual_first, f"{path}.{name}" if path else name))
        replaced[m.add] = fused
        m.add.replace_all_uses_with(fused)
        graph.erase_node(m.add)
        graph.erase_node(m.linear)
    graph.lint()


class ResidualLinear(Linear):
    """A converted :class:`~fusible.ops.Linear` whose residual add is fused: the layer's own
    state (the parameters under their names, FP8 states, hooks) with an ``AddExtraInput``
    after it, called as ``layer(y, residual)``."""

    _add: AddExtraInput
    _unfused: Linear

    @classmethod
    def of(cls, linear: Linear) -> "ResidualLinear":
        new = cls.__new__(cls)
        new.__dict__.update(without_layout(linear.__dict__.copy()))  # the same dicts
        object.__setattr__(new, "_add", AddExtraInput().train(linear.training))
        object.__setattr__(new, "_unfused", linear)  # the layer alone, for unfused adds
        tokens.register(new)  # what __init__ does: compiled graphs name it by token
        return new

    def basic_ops(self):
        return (*super().basic_ops(), self._add)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", residual_add=True"


def _has_call_hooks(module: nn.Module) -> bool:
    return any(getattr(module, name) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _with_residual_add(child: PipelineModule) -> PipelineModule:
    """``child`` ending in an ``AddExtraInput``: a Sequential gets it appended, a Linear
    becomes a :class:`ResidualLinear` (their names stay); another op, or a Linear with
    hooks (which see the layer's own arguments), is wrapped, its checkpoints kept under its
    names by hooks."""
    add = AddExtraInput().train(child.training)  # the mode of the module it joins
    if type(child) is Linear and not _has_call_hooks(child):
        return ResidualLinear.of(child)
    if isinstance(child, Sequential):
        name = str(len(child))
        child.add_module(name if name not in child._modules else "residual_add", add)
        return child
    block = Sequential(collections.OrderedDict(  # type: ignore[arg-type]
        [("linear", child), ("residual_add", add)]))
    block.training = child.training
    CheckpointNames(tuple((f"linear.{key}", (key,), ()) for key in child.state_dict())
                    ).install(block)
    return block


def residual_add(block: PipelineModule, input: Any, residual: Any, out_features: int,
                 residual_first: bool, path: str) -> Any:
    """``residual + block's body(input)`` as the original forward wrote it: through
    ``block(input, residual)`` (the fused add) where the residual has the shape, dtype and
    device of the body's output, else as the add of the body's output (which broadcasts
    and promotes as the original did)."""
    if _fits(input, residual, out_features):
        output = block(input, residual)
        if output.dtype != residual.dtype:
            raise RuntimeError(f"{path}: the fused residual add gave {output.dtype} for a "
                               f"residual of {residual.dtype} (input {input.dtype}); "
                               f"convert(model, fuse_residuals=False) leaves the add as is")
        return output
    if isinstance(block, ResidualLinear):
        body = block._unfused(input)
    else:
        body = input
        for item in list(cast(Sequential, block))[:-1]:  # before the AddExtraInput, in order
            body = item(body)
    return residual + body if residual_first else body + residual


def _fits(input: Any, residual: Any, out_features: int) -> bool:
    """Whether ``residual`` is what AddExtraInput takes for the body's output: its shape,
    device and dtype (under torch.autocast the linear layer computes in the autocast
    dtype, and a residual of another dtype would promote the sum)."""
    if not (isinstance(input, Tensor) and isinstance(residual, Tensor)):
        return False
    kind = input.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else input.dtype
    return (residual.dtype == dtype and residual.device == input.device
            and residual.shape == (*input.shape[:-1], out_features))
