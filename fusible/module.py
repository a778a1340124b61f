"""The runnable modules: the base that runs a pipeline, the operation bases users
subclass, and Sequential, the pipeline users build, plan and run."""

from __future__ import annotations

import collections
import weakref
from typing import Any, Iterable, Iterator, cast

import torch
from torch import nn

from fusible.core import epoch, tokens
from fusible.core.conditions import PlanConditions
from fusible.core.lanes import splitting
from fusible.core.hooks import ReplanOnHooks, has_hooks
from fusible.core.fused import FusedOperation
from fusible.core.operation import BasicOperationSpec, FusibleSpec
from fusible.planning.features.channels import caller_counts
from fusible.planning.plan import FusionPlan
from fusible.quantization.recipes.autocast import current_key, fp8_recipe
from fusible.runtime.compiled import compiled_forward
from fusible.runtime.layout import Called, Layout, layout_of, without_layout


class PipelineModule(ReplanOnHooks, nn.Module):
    """An ``nn.Module`` that runs as a fusible pipeline (a Sequential, or one op alone):
    the runtime's :class:`~fusible.runtime.layout.PipelineHost`, which caches its layout
    with the plans.

    The cache carries the epoch it was built in and is rebuilt when the epoch has
    moved on; ``.to()`` and friends move it on, and pickling leaves the cache out.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tokens.register(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        tokens.register(self)

    def layout_entries(self, global_hooks: bool) -> tuple:
        """``(entries, left out)`` of the layout (see
        :meth:`~fusible.runtime.layout.PipelineHost.layout_entries`)."""
        return _entries(self, global_hooks)

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor):
        """Run the pipeline (a lone op: like a one-element Sequential), planned and fused;
        under torch.compile through the stages' custom ops."""
        if torch.compiler.is_compiling():
            return compiled_forward(self, input, extra_inputs)
        return layout_of(self).run_eager(input, extra_inputs, self.training)

    def pipeline(self) -> tuple:
        """The flattened pipeline: basic ops and ordinary modules, in order.

        Plan stage indices are positions in this tuple.
        """
        layout = layout_of(self)
        return (self,) if layout.lone else layout.items

    def plan(self, *example_inputs: torch.Tensor) -> FusionPlan:
        """The :class:`~fusible.FusionPlan` for the current grad mode, recipe and training mode.

        Parameters
        ----------
        *example_inputs : Tensor, optional
            ``(x, *extra_inputs)`` as they would be passed to the model; their
            dtype, device and ``requires_grad`` shape the plan. Without them the
            input is assumed to have the parameters' dtype and device and not
            to require grad.
        """
        layout = layout_of(self)
        return layout.plan(_plan_conditions(layout, example_inputs, self.training),
                           fp8_recipe())

    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), to_empty() may replace parameter objects behind __setattr__.
        result = super()._apply(fn, recurse)
        epoch.bump_if_planned(self)
        return result

    def __getstate__(self):
        state = without_layout(self.__dict__.copy())
        state.pop("_fusible_owner", None)  # a weak link the owner re-makes
        return state


def _plan_conditions(layout: Layout, example_inputs: tuple, training: bool) -> PlanConditions:
    """The conditions of calling the pipeline on ``example_inputs``; without them, an input
    of the parameters' dtype and device that does not require grad."""
    params = layout.params()
    if example_inputs:
        x, extras = example_inputs[0], example_inputs[1:]
        if len(extras) != layout.num_extra_inputs:
            raise TypeError(f"plan() got {len(extras)} extra input(s); the Sequential takes "
                            f"{layout.num_extra_inputs}")
        return PlanConditions.of(x, params, extras, current_key(), training)
    first = params[0] if params else next(iter(
        p for item in layout.items for p in item.parameters()), None)
    dtype = first.dtype if first is not None else torch.get_default_dtype()
    device_type = first.device.type if first is not None else "cpu"
    grad = torch.is_grad_enabled()
    return PlanConditions(dtype, device_type, grad, False,
                          tuple(grad and p.requires_grad for p in params),
                          (False,) * layout.num_extra_inputs, current_key(), training,
                          grad and splitting())


def flatten(module: nn.Module, root: bool = True, global_hooks: bool = False) -> list:
    """Basic ops and ordinary modules of ``module``, nested Sequentials flattened; an
    operation or Sequential below the root that has module hooks stays whole (it runs as
    its own module call, see ``fusible.core.hooks``), and every one does while global
    module hooks are registered (``global_hooks``), so that they see each module of the
    model as torch.nn would call them (a ``Linear``, not only its BasicLinear and Bias)."""
    if isinstance(module, (FusibleSpec, Sequential)):
        epoch.mark_planned(module)  # from now on its changes move the epoch
        if not root and (global_hooks or has_hooks(module)):
            return [module]
    if isinstance(module, FusibleSpec):
        return list(module.basic_ops())
    if isinstance(module, Sequential):
        return [item for child in module
                for item in flatten(child, root=False, global_hooks=global_hooks)]
    return [module]


def _entries(root: nn.Module, global_hooks: bool) -> tuple:
    """``(entries, left out)``: the layout's entries, basic ops that run in groups and
    :class:`Called` items (ordinary modules; ops and Sequentials with hooks; every op while
    global hooks are registered), and the ops left out of plans."""
    if isinstance(root, BasicOperationSpec):
        # A lone op: its layout refers to it weakly, or op -> layout -> op would be a
        # reference cycle, freed only by the cyclic GC (the autograd node holds it while
        # a backward is pending). Its own hooks run around this very call.
        epoch.mark_planned(root)
        return [weakref.proxy(root)], ()
    items = flatten(root, global_hooks=global_hooks)
    plain = [isinstance(item, BasicOperationSpec) and not (global_hooks or has_hooks(item))
             for item in items]
    left_out = _left_out_of_plans(items, plain)
    skipped = {id(op) for op in left_out}
    entries: list = []  # basic ops, and Called items
    for item, is_plain in zip(items, plain):
        if id(item) in skipped:
            continue
        if is_plain:
            entries.append(item)
            continue
        ops = flatten(item) if isinstance(item, (FusibleSpec, Sequential)) else ()
        entries.append(Called(item, *caller_counts(
            [op for op in ops if isinstance(op, BasicOperationSpec)])))
    return entries, tuple(left_out)


def _left_out_of_plans(items: list, plain: list) -> list:
    """The plain ops left out of plans (``left_out_of_plans``) where another op remains
    (an op alone keeps its own plan)."""
    same = [i for i, p in zip(items, plain) if p and cast(Any, i).left_out_of_plans()]
    return same if len(same) < len(items) else []


def outermost_fusible(model: nn.Module) -> list:
    """The fusible modules of ``model`` (Sequentials, lone ops) not inside another one,
    in module order: what runs as its own pipeline."""
    if isinstance(model, (Sequential, FusibleSpec)):
        return [model]
    return [m for child in model.children() for m in outermost_fusible(child)]


class FusibleOperation(PipelineModule, FusibleSpec):
    """An operation that can stand in a :class:`Sequential`: a basic op, or a composite such
    as :class:`~fusible.ops.Linear` that expands into basic ops. Calling one on its own
    runs it as a one-element pipeline."""


class BasicOperation(FusibleOperation, BasicOperationSpec, abstract=True):
    """The base class of basic operations: subclass it (see
    :class:`~fusible.core.operation.BasicOperationSpec` for the contract and
    :class:`~fusible.core.stage.StageSpec` for each hook)."""


class Sequential(PipelineModule):
    """A pipeline of fusible operations, planned and fused as a whole.

    Behaves like ``torch.nn.Sequential`` for indexing, iteration, ``len``,
    ``append``, ``extend``, ``insert``, ``pop``, deletion, ``+`` and ``+=``, and keeps
    the same state_dict names. Nested Sequentials are flattened into one pipeline for
    planning, so fusions cross their boundaries. An ordinary ``nn.Module``
    inside runs as is and splits the pipeline into separately planned groups.

    ``model(x, *extra_inputs)`` gives the extra inputs, in order, to the
    ``AddExtraInput`` ops; if the pipeline has ``MakeExtraOutput`` ops it returns
    ``(y, *extra_outputs)``, else ``y``.

    Parameters
    ----------
    *modules : nn.Module or one OrderedDict
        Fusible operations, Sequentials or ordinary modules, in order; or, as for
        ``nn.Sequential``, one ``OrderedDict`` of them by name.
    """

    def __init__(self, *modules: nn.Module):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], collections.OrderedDict):
            for name, module in modules[0].items():
                self._check_module(module)
                self.add_module(name, module)
            return
        for module in modules:
            self.append(module)

    # nn.Sequential behaviour ------------------------------------------------------

    def append(self, module: nn.Module) -> "Sequential":
        """Add a module at the end."""
        self._check_module(module)
        self.add_module(str(len(self)), module)
        return self

    def add_module(self, name: str, module: "nn.Module | None") -> None:
        # Every structural change (append, insert, register_module, attribute
        # assignment of a module) goes through here or __delattr__: re-plan.
        super().add_module(name, module)
        epoch.bump_if_planned(self)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if isinstance(value, nn.Module):  # nn.Module stores it without add_module
            epoch.bump_if_planned(self)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        epoch.bump_if_planned(self)

    def extend(self, modules: Iterable[nn.Module]) -> "Sequential":
        for module in modules:
            self.append(module)
        return self

    def insert(self, index: int, module: nn.Module) -> "Sequential":
        items = list(self)
        items.insert(index, module)
        self._reset(items)
        return self

    def pop(self, index: "int | slice" = -1) -> nn.Module:
        """Remove and return the module at ``index`` (a slice: a Sequential of them)."""
        removed = self[index]
        del self[index]
        return removed

    def __add__(self, other: "Sequential") -> "Sequential":
        """A new Sequential of this one's modules, then ``other``'s (the same module
        objects, as ``nn.Sequential`` does)."""
        _check_sequential("+", other)
        return Sequential(*self, *other)

    def __iadd__(self, other: "Sequential") -> "Sequential":
        _check_sequential("+=", other)
        return self.extend(list(other))  # a list first: `model += model` doubles it once

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        # cast: nn.Module types its children Optional; a Sequential's are modules
        return iter(cast("dict[str, nn.Module]", self._modules).values())

    def __getitem__(self, index):
        items = list(self._modules.values())
        if isinstance(index, slice):
            return Sequential(*items[index])
        return items[self._index(index)]

    def __setitem__(self, index: int, module: nn.Module) -> None:
        self._check_module(module)
        items = list(self)
        items[self._index(index)] = module
        self._reset(items)

    def __delitem__(self, index) -> None:
        items = list(self)
        del items[index if isinstance(index, slice) else self._index(index)]
        self._reset(items)

    def _index(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a Sequential of {n} modules")
        return index % n

    def _reset(self, items: list) -> None:
        for key in list(self._modules):
            del self._modules[key]
        epoch.bump_if_planned(self)
        for item in items:
            self.append(item)

    @staticmethod
    def _check_module(module) -> None:
        if isinstance(module, FusedOperation):
            raise TypeError(f"{type(module).__name__} is a fusion; the planner creates fusions, "
                            f"put the basic ops in the Sequential instead")
        if not isinstance(module, nn.Module):
            raise TypeError(f"Sequential takes nn.Module instances, got {type(module).__name__}")


def _check_sequential(operator: str, other) -> None:
    """``+`` and ``+=`` take a fusible Sequential; ValueError otherwise, as nn.Sequential's."""
    if not isinstance(other, Sequential):
        raise ValueError(f"fusible Sequential {operator} takes a fusible Sequential, got "
                         f"{type(other).__module__}.{type(other).__qualname__}")
