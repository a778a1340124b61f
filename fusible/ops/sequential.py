"""Sequential: the pipeline users build, plan and run."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from fusible import _epoch
from fusible.ops.base import FusedOperation, PlanCachingModule
from fusible.quantization.recipe import fp8_recipe


class Sequential(PlanCachingModule):
    """A pipeline of fusible operations, planned and fused as a whole.

    Behaves like ``torch.nn.Sequential`` for indexing, iteration, ``len``,
    ``append``, ``extend``, ``insert`` and deletion, and keeps the same
    state_dict names. Nested Sequentials are flattened into one pipeline for
    planning, so fusions cross their boundaries. An ordinary ``nn.Module``
    inside runs as is and splits the pipeline into separately planned groups.

    ``model(x, *extra_inputs)`` gives the extra inputs, in order, to the
    ``AddExtraInput`` ops; if the pipeline has ``MakeExtraOutput`` ops it returns
    ``(y, *extra_outputs)``, else ``y``.

    Parameters
    ----------
    *modules : nn.Module
        Fusible operations, Sequentials or ordinary modules, in order.
    """

    def __init__(self, *modules: nn.Module):
        super().__init__()
        for module in modules:
            self.append(module)

    # nn.Sequential behaviour ------------------------------------------------------

    def append(self, module: nn.Module) -> "Sequential":
        """Add a module at the end."""
        self._check_module(module)
        self.add_module(str(len(self)), module)
        return self

    def add_module(self, name: str, module) -> None:
        # Every structural change (append, insert, register_module, attribute
        # assignment of a module) goes through here or __delattr__: re-plan.
        super().add_module(name, module)
        _epoch.bump_if_planned(self)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if isinstance(value, nn.Module):  # nn.Module stores it without add_module
            _epoch.bump_if_planned(self)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        _epoch.bump_if_planned(self)

    def extend(self, modules: Iterable[nn.Module]) -> "Sequential":
        for module in modules:
            self.append(module)
        return self

    def insert(self, index: int, module: nn.Module) -> "Sequential":
        items = list(self)
        items.insert(index, module)
        self._reset(items)
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

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
        _epoch.bump_if_planned(self)
        for item in items:
            self.append(item)

    @staticmethod
    def _check_module(module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Sequential takes nn.Module instances, got {type(module).__name__}")
        if isinstance(module, FusedOperation):
            raise TypeError(f"{type(module).__name__} is a fusion; the planner creates fusions, "
                            f"put the basic ops in the Sequential instead")

    # Pipeline ---------------------------------------------------------------------

    def pipeline(self) -> tuple:
        """The flattened pipeline: basic ops and ordinary modules, in order.

        Plan stage indices are positions in this tuple.
        """
        return self._layout().items

    def plan(self, *example_inputs: torch.Tensor):
        """The :class:`~fusible.FusionPlan` for the current grad mode.

        Parameters
        ----------
        *example_inputs : Tensor, optional
            ``(x, *extra_inputs)`` as they would be passed to the model; their
            dtype, device and ``requires_grad`` shape the plan. Without them the
            input is assumed to have the parameters' dtype and device and not
            to require grad.
        """
        from fusible.plan import build_plan, plan_conditions

        layout = self._layout()
        dtype, device_type, input_rg, extras_rg = plan_conditions(layout, example_inputs,
                                                                  self.parameters())
        return build_plan(layout, dtype, device_type, torch.is_grad_enabled(), input_rg, extras_rg,
                          fp8_recipe())

