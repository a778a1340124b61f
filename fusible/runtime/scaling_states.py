"""FP8 scaling states in a run: each op's to its context, a stage's hand-off bound to the
state of the op that takes it (see ``planning.prepare.state_owners``)."""

from __future__ import annotations


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


def check_states(plan, states, x) -> None:
    """The states the plan reads: as many as it has slots, on the input's device."""
    if len(states) != len(plan.state_slots):
        raise RuntimeError(f"{len(states)} FP8 scaling states for a plan reading "
                           f"{len(plan.state_slots)}")
    for (index, role), state in zip(plan.state_slots, states):
        if state.device != x.device:
            raise RuntimeError(f"{plan.ops[index].describe()} keeps its FP8 {role} scaling "
                               f"state (buffer fp8_state_{role}) on {state.device} but got "
                               f"input on {x.device}: move the model with .to({x.device})")
