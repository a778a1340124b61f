"""The ``main_grad`` feature's planning pass: parameters whose gradient is added into a
float32 ``main_grad`` buffer (Megatron-style, ``op.main_grad_params``) instead of going to
autograd (``runtime/features/main_grad.py`` adds them)."""

from __future__ import annotations

from typing import Optional

import attrs

from fusible.planning.exec_plan import Preparation


@attrs.frozen
class MainGrads:
    """The parameters (indices among the group's) whose gradient goes into their
    ``main_grad``, where a gradient is needed, and their ``(op, name)``."""

    params: tuple
    owners: tuple


def attach(prep: Preparation, attached: dict) -> Optional[MainGrads]:
    owners = [(op, name) for op in prep.ops for name in op.param_names]
    needed = [p for n in prep.needs for p in n.params]
    chosen = tuple(k for k, (op, name) in enumerate(owners)
                   if needed[k] and name in op.main_grad_params)
    if not chosen:
        return None
    return MainGrads(chosen, tuple(owners[k] for k in chosen))
