"""Passes over a group of basic ops and its planned stages: gradient needs, the
sequence-parallel check, the FP8 hand-off between stages, and collectives for plans."""

from __future__ import annotations

from typing import Optional

from fusible.core.results import OpGradNeeds
from fusible.functional.parallel import NOT_PARALLEL, TensorParallel
from fusible.planning.exec_plan import stage_recipe
from fusible.planning.features.channels import channel_of, write_channel_of


def op_grad_needs(ops, conditions) -> tuple:
    """Which gradients each op must produce, from what requires grad upstream.

    ``conditions.params_requires_grad`` and ``extras_requires_grad`` are the group's own,
    in order (the extra inputs the caller passes); with grad disabled nothing is needed. An
    extra input from a channel requires grad where its writer's input does.
    """
    grad = conditions.grad_enabled
    needs, upstream = [], grad and conditions.input_requires_grad
    params_rg, extras_rg = conditions.params_requires_grad, conditions.extras_requires_grad
    p_pos = e_pos = 0
    channel_rg: dict = {}
    for op in ops:
        n, k, name = len(op.param_names), op.num_extra_inputs, channel_of(op)
        params = tuple(grad and bool(r) for r in params_rg[p_pos:p_pos + n])
        if write_channel_of(op) is not None and op.num_extra_outputs:
            channel_rg[write_channel_of(op)] = upstream
        if name is not None:
            extras = (channel_rg.get(name, False),) * k
        else:
            extras = tuple(grad and bool(r) for r in extras_rg[e_pos:e_pos + k])
            e_pos += k
        p_pos += n
        needs.append(OpGradNeeds(upstream, params, extras))
        upstream = upstream or any(params) or any(extras)
    return tuple(needs)


def check_sequence_parallel(ops) -> None:
    """Ops with parameters that see tokens split over a group (before a column + SP
    linear layer, after a row + SP one) must all-reduce their gradients: an error names
    any that would not, rather than letting ranks' replicated parameters drift apart."""
    tps = [getattr(op, "parallel", NOT_PARALLEL) for op in ops]
    # per op: the group its input's tokens are split over
    split: list[Optional[TensorParallel]] = [None] * len(ops)
    state = None
    for i, tp in enumerate(tps):  # after a row + SP layer, until a column + SP one
        state = None if tp.gathers_input else state
        split[i] = state
        state = tp if tp.scatters_output else state
    state = None
    for i in reversed(range(len(ops))):  # before a column + SP layer, back to a row + SP one
        tp = tps[i]
        if tp.gathers_input:
            state = tp
            continue
        state = None if tp.scatters_output else state
        split[i] = split[i] or state
    for op, tp in zip(ops, split):
        if tp is not None and op.param_names and not _parallel_param_op(op):
            raise ValueError(f"{op.describe()} sees tokens split over the tensor-parallel group "
                             f"(sequence parallelism around it), so each rank would sum only "
                             f"its own tokens into its parameter gradients: construct it with "
                             f"sequence_parallel=True")


def check_gated_layouts(ops) -> None:
    """After a column-parallel layer each rank holds a contiguous slice of the features,
    until an op that mixes them: every op meanwhile answers ``check_split_features`` (a
    gated unit refuses the halves-one-after-the-other layout there, whose slices would
    pair the wrong values)."""
    producer = None
    for op in ops:
        if producer is not None:
            op.check_split_features(producer.describe(), producer.parallel.world_size)
        tp = getattr(op, "parallel", NOT_PARALLEL)
        if op.keeps_features:  # a column-parallel bias included: the split goes on
            continue
        producer = op if tp.mode == "column" and tp.active else None


def _parallel_param_op(op) -> bool:
    """An op whose parameters are shards, or whose gradients the fuser all-reduces."""
    tp = getattr(op, "parallel", None)
    return op.grad_reduction() is not None or (tp is not None and tp.mode is not None)


def hand_off_formats(forward: list, backward: list, needs: tuple, op_recipes: tuple) -> tuple:
    """Under the ops' recipes (``op_recipes``, one per op), the format each stage hands its
    output (forward) or input gradient (backward) over in: what the next stage asks for
    with ``input_format`` / ``grad_format`` under its own recipe (None: a plain tensor).
    The producer then quantizes inside its own stage (its custom op, when compiled).

    ``forward`` and ``backward`` are the prepared stages in execution order; returns
    ``(forward formats, backward formats)``, one per stage.
    """
    fwd = [None] * len(forward)
    bwd = [None] * len(backward)
    for k in range(len(forward) - 1):
        nxt = forward[k + 1]
        recipe = stage_recipe(nxt, op_recipes, "forward")
        if recipe is not None:
            fwd[k] = nxt.op.input_format(recipe, needs[nxt.lo:nxt.hi])
    for k in range(len(backward) - 1):
        nxt = backward[k + 1]
        recipe = stage_recipe(nxt, op_recipes, "backward")
        if recipe is not None:
            bwd[k] = nxt.op.grad_format(recipe, needs[nxt.lo:nxt.hi])
    return fwd, bwd


def op_communication(op, direction: str, needs=None) -> tuple:
    """``(where, what)`` collectives of ``op`` in ``direction`` (for the gradients in
    ``needs``, when given): those of its compute, and the all-reduce of its parameter
    gradients (``grad_reduction``) after a backward stage. Ordinary modules: none."""
    if not hasattr(op, "communication"):
        return ()
    comm = tuple(op.communication(direction, needs))
    tp = op.grad_reduction()
    if direction == "backward" and tp is not None and (needs is None or any(needs.params)):
        grads = ", ".join("d" + name for name in op.param_names)
        comm += (("after", f"all-reduce {grads} /{tp.world_size}"),)
    return comm
