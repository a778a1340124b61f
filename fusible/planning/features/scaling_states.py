"""The scaling-states feature's planning pass: under a recipe whose formats keep state
(delayed scaling's amax histories), each op keeps one state per FP8 tensor role
(``op.scaling_state_roles``) as a buffer, and a stage that hands the next op (the previous
one, backward) a tensor in a stateful format casts it with that op's state
(``runtime/features/scaling_states.py`` passes the states and binds the formats)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from fusible.planning.exec_plan import ExecStage, Preparation


@attrs.frozen
class ScalingStates:
    """The states a group's stages read.

    Attributes
    ----------
    slots : tuple
        ``(op index, role)`` of every state, in the order the runtime passes them.
    sizes : tuple of int
        The number of float32 values of each.
    forward_outputs, backward_outputs : tuple
        ``((stage lo, (op index, role)), ...)``: the stages whose output (input gradient)
        goes out in a stateful format, bound at each call to that op's state.
    """

    slots: tuple
    sizes: tuple
    forward_outputs: tuple = ()
    backward_outputs: tuple = ()


def attach(prep: Preparation, attached: dict) -> Optional[ScalingStates]:
    # every stateful hand-off needs its owner, states or not (an error names the stage)
    forward, backward = _bound_outputs(prep.forward, "input"), _bound_outputs(prep.backward,
                                                                               "grad")
    recipe = prep.recipe
    slots = make_states(prep.ops, recipe, prep.conditions.device_type)
    if not slots:
        return None
    return ScalingStates(slots, tuple(recipe.role_format(role).scaling.state_size
                                      for _, role in slots), forward, backward)


def state_owners(ops, recipe) -> tuple:
    """``(op index, role)`` of every FP8 state the ops keep under ``recipe`` (none unless
    its formats are stateful), in the order the runtime passes them."""
    if recipe is None or not recipe.stateful:
        return ()
    return tuple((i, role) for i, op in enumerate(ops) for role in op.scaling_state_roles)


def make_states(ops, recipe, device_type: str) -> tuple:
    """:func:`state_owners`, each state made (or made float32 again, or moved) where
    missing or not fitting: on its op's parameters' device, else the group's, else the
    device type's current device."""
    slots = state_owners(ops, recipe)
    if len({id(op) for op in ops}) != len(ops) and slots:
        raise NotImplementedError(f"an op stands twice in one pipeline ({ops}): under "
                                  f"{recipe.name} scaling each op keeps one state per role, "
                                  f"which would record both uses; use two ops")
    if slots:
        params = [p for op in ops for p in op.parameters()]
        for i, role in slots:
            own = next(iter(ops[i].parameters()), None)
            device = (own if own is not None else params[0]).device if params else \
                torch.device(device_type)
            ops[i].scaling_state(role, recipe.role_format(role).scaling.state_size, device)
    return slots


def _bound_outputs(stages: tuple, role: str) -> tuple:
    """``(lo, owner)`` of each stage whose hand-off format is stateful: the owner is the
    one op of the next stage that keeps ``role`` state."""
    found = []
    for st, consumer in zip(stages, stages[1:]):
        if st.output_format is not None and st.output_format.stateful:
            found.append((st.lo, _state_owner(consumer, role)))
    return tuple(found)


def _state_owner(consumer: ExecStage, role: str) -> tuple:
    """``(index, role)`` of the one op of ``consumer`` that keeps state ``role``: the
    stage asking for its input (gradient) in a stateful format casts with it."""
    owners = [consumer.lo + j for j, op in enumerate(consumer.ops)
              if role in op.scaling_state_roles]
    if len(owners) != 1:
        raise ValueError(f"the stage {consumer.provenance} asks for its "
                         f"{'input' if role == 'input' else 'gradient'} in a stateful FP8 "
                         f"format, which needs the one op it covers that keeps {role!r} "
                         f"state (scaling_state_roles); it covers {len(owners)}")
    return owners[0], role
