"""Reading a group's parameters for a call: the tensors its ops compute with, afresh each
call (FSDP2, ``.to()`` and parametrizations swap them)."""

from __future__ import annotations


class GroupParams:
    """The parameters of a group's ops (``param_names``, in op order).

    Registered parameters are read straight from the ops' parameter dicts (the common,
    fast case); where a parametrization or pruning took one out of its dict, every op
    says what it computes with instead (``op.param(name)``: slower; a plan is made again
    when they come or go).
    """

    def __init__(self, ops: tuple):
        self._slots = [(op._parameters, name) for op in ops for name in op.param_names]
        self._owners = [(op, name) for op in ops for name in op.param_names]
        for params, name in self._slots:
            if name in params and params[name] is None:
                op = next(op for op in ops if op._parameters is params)
                raise TypeError(f"{op.describe()} has no {name} (it was set to None); "
                                f"{op.__class__.__name__} computes with one")
        self._direct = all(name in d for d, name in self._slots)
        self.count = len(self._slots)

    def read(self, ops: "tuple | None" = None) -> list:
        """The tensors, in order; ``ops``: the group's ops themselves, where the group
        holds a lone op's proxy (code dynamo traces cannot read through it)."""
        if self._direct:
            return [params[name] for params, name in self._slots]
        if ops is None:
            return [op.param(name) for op, name in self._owners]
        return [op.param(name) for op in ops for name in op.param_names]
