"""PlanConditions: everything besides the ops that a plan depends on, as one value."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fusible.core.lanes import splitting


class PlanConditions(NamedTuple):
    """The conditions a plan is made for: cache key, compiled-graph constant (a plain
    tuple of constants, which dynamo guards on) and the planner's environment, all one.

    Attributes
    ----------
    dtype : torch.dtype
        Dtype of the pipeline input.
    device_type : str
        ``"cpu"``, ``"cuda"``, ...
    grad_enabled : bool
        Whether autograd records the call.
    input_requires_grad : bool
        Whether the input requires grad (False with grad disabled).
    params_requires_grad : tuple of bool
        Per parameter of the pipeline (or group), in order (all False with grad disabled).
    extras_requires_grad : tuple of bool
        Per extra input (all False with grad disabled).
    recipe_key : str or None
        The key of the FP8 recipe in effect (``recipe.key``), None without one.
    training : bool
        The training mode of the module being run.
    split_backward : bool
        The backward runs in two lanes, weight gradients deferred
        (:func:`fusible.split_backward`).
    """

    dtype: torch.dtype
    device_type: str
    grad_enabled: bool
    input_requires_grad: bool
    params_requires_grad: tuple
    extras_requires_grad: tuple
    recipe_key: Optional[str]
    training: bool
    split_backward: bool = False

    @classmethod
    def of(cls, x: torch.Tensor, params, extra_inputs, recipe_key,
           training: bool) -> "PlanConditions":
        """The conditions of running on ``x`` with these parameters and extra inputs."""
        return cls(*conditions_key(x, x.device.type, params, extra_inputs, recipe_key,
                                   training))


def conditions_key(x: torch.Tensor, device_type: str, params, extra_inputs, recipe_key,
                   training: bool) -> tuple:
    """The :class:`PlanConditions` of running on ``x`` (on ``device_type``), as the plain
    tuple that is the plan cache key (it hashes and compares equal to the PlanConditions).
    With grad disabled nothing requires grad. ``params`` None leaves the parameters'
    pattern to be filled in where they are read (the compiled path, at trace time)."""
    if torch.is_grad_enabled():
        return (x.dtype, device_type, True, x.requires_grad,
                None if params is None else tuple([p.requires_grad for p in params]),
                tuple([e.requires_grad for e in extra_inputs]), recipe_key, training,
                splitting())
    return (x.dtype, device_type, False, False, None if params is None else _falses(len(params)),
            _falses(len(extra_inputs)), recipe_key, training, False)


_FALSES = [(False,) * n for n in range(64)]


def _falses(n: int) -> tuple:
    return _FALSES[n] if n < 64 else (False,) * n
