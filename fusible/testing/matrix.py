"""The test matrix follows the registry: every operation exported by ``fusible.ops`` and
every registered fusion brings an ``example()``; these helpers enumerate and build them,
so that adding one op or fusion file adds its eager, compiled, opcheck and FP8 tests."""

from __future__ import annotations

import contextlib

import attrs
import torch
import torch.distributed as dist

from fusible import ops
from fusible.core.fused import FusedOperation
from fusible.core.operation import BasicOperationSpec
from fusible.module import Sequential
from fusible.planning.registry import registered_fusions
from fusible.testing.reference import exact_parameters_, exact_tensor


@attrs.frozen
class Case:
    """One op or fusion to test: its class and which stage the plan must show."""

    cls: type[BasicOperationSpec] | type[FusedOperation]
    direction: str  # "both": a stage in each pass (a basic op, or a joint fusion)

    @property
    def name(self) -> str:
        return self.cls.__name__


def operation_classes() -> list:
    """The basic-op classes ``fusible.ops`` exports (concrete ones), sorted by name."""
    found = {v for v in vars(ops).values()
             if isinstance(v, type) and issubclass(v, BasicOperationSpec)
             and v.fwd_args_type is not None}
    return sorted(found, key=lambda c: c.__name__)


def cases() -> list:
    """A :class:`Case` per exported basic op and per registered fusion."""
    return ([Case(c, "both") for c in operation_classes()]
            + [Case(f, f.direction) for f in registered_fusions()])


@contextlib.contextmanager
def single_rank_group():
    """A one-process gloo group for the duration (ops with collectives need a group);
    nothing happens when a group exists already."""
    if not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(case: Case, dtype: torch.dtype, device="cpu", seed: int = 0):
    """``(model, inputs, example)`` for ``case``: the example's pipeline with exactly
    representable parameters and inputs in ``dtype`` on ``device`` (call inside
    :func:`single_rank_group`)."""
    example = case.cls.example()
    if example is None:
        raise LookupError(f"{case.name} has no example()")
    gen = torch.Generator().manual_seed(seed)
    model = Sequential(*example.ops).to(device=device, dtype=dtype)
    exact_parameters_(model, generator=gen)
    for i in example.frozen:
        example.ops[i].requires_grad_(False)
    rg = example.input_requires_grad
    inputs = [exact_tensor(shape, dtype, device=device, generator=gen).requires_grad_(rg)
              for shape in (example.input_shape, *example.extra_input_shapes)]
    inputs += [t.to(device) for t in example.extra_input_values]
    return model, inputs, example


def expected_stages(case: Case) -> dict:
    """``{"forward": [...], "backward": [...]}``: the stage names a plan must contain."""
    if case.direction == "both":
        return {"forward": [case.name], "backward": [case.name]}
    return {case.direction: [case.name]}
