"""FP8 scaling states at run time (delayed scaling's amax histories): each op's states
go to its context for the call, and a stage's stateful hand-off format is bound to the
state of the op that takes the tensor (``planning/features/scaling_states.py``).

Eagerly the states are the ops' own buffers; a forward records into them after keeping
a copy (a snapshot), from which activation checkpointing's recomputation casts, so that
it repeats the latest forward's scales. Compiled, they are graph inputs the graph writes
back (``fusible.runtime.custom_ops``)."""

from __future__ import annotations

import torch

from fusible.planning.features.scaling_states import make_states
from fusible.runtime.executor import Call, backward_result, forward_result
from fusible.runtime.features.base import RuntimeFeature, StageHooks


class ScalingStatesRuntime(RuntimeFeature):
    name = "scaling_states"

    def count(self, record) -> int:
        return len(record.slots)

    def call_tensors(self, record, plan, runner, x) -> list:
        states = _own_states(runner.ops)
        if not all(_fits(s, x, n) for s, n in zip(states, record.sizes)):
            # another history length, or .to() changed a state's dtype: made again
            make_states(runner.ops, plan.recipe, x.device.type)
            states = _own_states(runner.ops)
        return _for_call(runner.latest.current.snapshots, states,
                         [role for _, role in record.slots])

    def graph_tensors(self, runner, ops, params) -> list:
        return _own_states(ops)

    def begin_forward(self, record, call: Call) -> None:
        states = call.tensors[self.name]
        for (index, role), state, size in zip(record.slots, states, record.sizes):
            if not _fits(state, call.input, size):
                raise RuntimeError(
                    f"{call.plan.ops[index].describe()} keeps its FP8 {role} scaling state "
                    f"(buffer fp8_state_{role}) as {state.dtype} of shape {tuple(state.shape)} "
                    f"on {state.device}; its plan casts {call.input.device} inputs with {size} "
                    f"float32 values there (run the model once eagerly, or plan it, after "
                    f"moving it)")
            call.ctxs[index].states[role] = state

    def stage_hooks(self, record, st, direction: str):
        owners = dict(record.forward_outputs if direction == "forward"
                      else record.backward_outputs)
        if st.lo not in owners:
            return None
        index, role = owners[st.lo]
        compute_stage = forward_result if direction == "forward" else backward_result

        def compute(call: Call, st, args):
            fmt = st.output_format.bound(call.ctxs[index].states[role])
            return compute_stage(call.plan, call.traced, st, args, fmt)
        return StageHooks(compute=compute)


FEATURE = ScalingStatesRuntime()


def _own_states(ops) -> list:
    """Every role's state of every op that keeps some (made by the planning)."""
    return [op._buffers[f"fp8_state_{role}"] for op in ops for role in op.scaling_state_roles]


def _for_call(memory: dict, states: list, roles: list) -> list:
    """The states an eager call casts with. A forward records into the ops' own, after
    keeping a copy of them in its forward's ``memory`` (``ForwardState.snapshots``); one
    during a backward pass (activation checkpointing's recomputation) casts with copies of
    the copy its forward kept, and records nothing; its gradients' states stay the ops'
    own (a reentrant checkpoint runs its backward through them)."""
    snapshot = memory.get("fp8_states")
    if torch._C._current_graph_task_id() != -1 and snapshot is not None \
            and len(snapshot) == len(states):
        return [t.clone() if role != "grad" else own
                for t, own, role in zip(snapshot, states, roles)]
    if torch.is_inference_mode_enabled():  # nothing will be recomputed
        return states
    if snapshot is None or [t.shape for t in snapshot] != [t.shape for t in states] \
            or snapshot[0].device != states[0].device:
        memory["fp8_states"] = [t.clone() for t in states]
    else:
        torch._foreach_copy_(snapshot, states)
    return states


def _fits(state, x, size: int) -> bool:
    """Whether ``state`` is one of ``size`` float32 values on ``x``'s device."""
    return state.shape == (size,) and state.dtype == torch.float32 and state.device == x.device
