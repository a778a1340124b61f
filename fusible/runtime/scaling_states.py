"""FP8 scaling states in a run: each op's to its context, a stage's hand-off bound to the
state of the op that takes it (see ``planning.prepare.state_owners``)."""

from __future__ import annotations

import torch


def bound_output_format(st, ctxs):
    """The stage's stateful output format bound to the state of the op that takes the
    tensor (``st.output_state``)."""
    index, role = st.output_state
    return st.output_format.bound(ctxs[index].states[role])


def compute_into(st, args, fmt):
    """A stage's compute handed its bound output format, where its kernels write it."""
    if st.op.__class__.quantizes_own_output:
        return st.compute(args, output_format=fmt if fmt.kernel_cast else None)
    return st.compute(args)


def assign_states(plan, ctxs, states) -> None:
    """Give each op's context its FP8 scaling states for the call."""
    for (index, role), state in zip(plan.state_slots, states):
        ctxs[index].states[role] = state


def fits(state, x, size: int) -> bool:
    """Whether ``state`` is one of ``size`` float32 values on ``x``'s device."""
    return state.shape == (size,) and state.dtype == torch.float32 and state.device == x.device


def check_states(plan, states, x) -> None:
    """The states the plan reads: as many as it has slots, float32 values of its sizes on
    the input's device."""
    if len(states) != len(plan.state_slots):
        raise RuntimeError(f"{len(states)} FP8 scaling states for a plan reading "
                           f"{len(plan.state_slots)}")
    for (index, role), state, size in zip(plan.state_slots, states, plan.state_sizes):
        if not fits(state, x, size):
            raise RuntimeError(f"{plan.ops[index].describe()} keeps its FP8 {role} scaling "
                               f"state (buffer fp8_state_{role}) as {state.dtype} of shape "
                               f"{tuple(state.shape)} on {state.device}; its plan casts "
                               f"{x.device} inputs with {size} float32 values there (run the "
                               f"model once eagerly, or plan it, after moving it)")
