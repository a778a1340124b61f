"""A group's plan prepared for execution: stage slices, gradient masks, FP8 hand-offs."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import attrs
import torch

from fusible.core import tokens
from fusible.core.conditions import PlanConditions
from fusible.core.context import OperationContext
from fusible.planning.channels import Channels, channel_of, channels_of
from fusible.planning.passes import (check_gated_layouts, check_sequence_parallel,
                                     hand_off_formats, idle_needs, op_grad_needs)
from fusible.planning.planner import GroupPlan, PlanEnvironment, plan_group
from fusible.quantization.recipes.autocast import recipe_for_key


@attrs.frozen
class ExecStage:
    """A stage with the slices of the group's per-op state it reads and writes.

    ``output_format`` is the ``Float8Format`` in which the stage hands its output
    (forward) or its input gradient (backward) to the next stage; None for a plain
    tensor. ``compute`` is the op's compute classmethod, given that format when the op
    quantizes its own output. A stateful format (delayed scaling) is bound at each call
    to the state of the op that takes the tensor: ``output_state`` is ``(that op's
    index in the group, its role)``, and ``compute`` is left without the format.
    """

    op: Any             # the stage's op or fusion
    ops: tuple          # covered basic ops, forward order
    lo: int             # covered ops: [lo, hi) in the group
    hi: int
    extra_in: slice     # extra inputs consumed by covered ops
    extra_out: slice    # extra outputs produced by covered ops
    params: slice       # parameters of covered ops
    compute: Callable[..., Any]  # the op's forward_compute or backward_compute (bound)
    provenance: str     # names the stage in compiled graphs
    grad_mask: tuple = ()  # backward: (input, params, extra inputs) gradients needed
    output_format: Optional[Any] = None
    output_state: Optional[tuple] = None
    grad_sync: tuple = ()  # backward: (parameter index in the stage, group) to all-reduce
    # A split backward (fusible.split_backward): per parameter of the stage, whether its
    # gradient is deferred to the wgrad lane (empty: the stage does not split); the bound
    # dgrad_compute and wgrad_compute; the target the deferred records go to; per
    # parameter, whether its gradient goes into main_grad
    deferred: tuple = ()
    dgrad: object = None
    wgrad: object = None
    target: object = None
    into_main_grad: tuple = ()
    num_extra_in: int = attrs.field(init=False)
    num_extra_out: int = attrs.field(init=False)
    num_params: int = attrs.field(init=False)

    def __attrs_post_init__(self):  # counts read on the hot path
        for name, span in (("num_extra_in", self.extra_in), ("num_extra_out", self.extra_out),
                           ("num_params", self.params)):
            object.__setattr__(self, name, span.stop - span.start)


@attrs.frozen
class ExecPlan:
    """A :class:`GroupPlan` prepared for execution."""

    group: GroupPlan
    ops: tuple          # the group's basic ops
    forward: tuple
    backward: tuple     # only stages that take part in the backward pass
    needs: tuple        # OpGradNeeds per op
    needs_backward: bool
    input_needs_grad: bool
    num_params: int
    num_extra_inputs: int
    idle_ctxs: tuple    # contexts for calls that save nothing
    constant_extra_outputs: tuple  # extra outputs that depend on nothing requiring grad
    backward_stages: tuple  # the public Stages of `backward`
    recipe: object      # the FP8 recipe, or None
    validated: dict = attrs.field(factory=dict, eq=False)  # input signatures checked already
    # Parameters (indices among the group's) whose gradient goes into their main_grad
    # (op.main_grad_params, where a gradient is needed), and their (op, name)
    main_grad_params: tuple = ()
    main_grad_owners: tuple = ()
    # Extra inputs written in place (AddExtraInput(in_place=True)), with their ops
    in_place_extra_inputs: tuple = ()
    in_place_ops: tuple = ()
    channels: Optional[Channels] = None  # named channels between the ops, if any
    # Per op: (op, who reads its saved record, the record's type), see stash_saved
    saved_readers: tuple = ()
    # Under a recipe with stateful formats: (op index, role) of every state the group's
    # stages read, in the order the runner passes the states (op.scaling_state_roles),
    # and the number of values of each
    state_slots: tuple = ()
    state_sizes: tuple = ()
    # A split backward: the public Stages of the wgrad lane (direction "wgrad"), and
    # (Stage, reason) of the stages with parameter gradients that stay in the dgrad lane
    wgrad_stages: tuple = ()
    wgrad_kept: tuple = ()

    @property
    def conditions(self) -> PlanConditions:
        return self.group.env.conditions

    @property
    def quantized_results(self) -> bool:
        """Whether stage results may be Float8Tensors (an FP8 recipe is in effect)."""
        return self.recipe is not None

    @property
    def outer_dtype(self):
        """Under an FP8 recipe, the dtype Float8Tensors dequantize to; else None."""
        return None if self.recipe is None else self.conditions.dtype


def prepare_group(ops: tuple, start: int, conditions: PlanConditions) -> ExecPlan:
    """Plan a group of ``ops`` (the first at ``start``) for the group's ``conditions``."""
    channels = channels_of(ops)
    needs = op_grad_needs(ops, conditions)
    recipe = recipe_for_key(conditions.recipe_key)
    env = PlanEnvironment(conditions, {start + i: n for i, n in enumerate(needs)})
    check_sequence_parallel(ops)
    check_gated_layouts(ops)
    group = plan_group(ops, start, env)
    forward = [_exec_stage(ops, start, s, False, needs) for s in group.forward]
    backward = [(_exec_stage(ops, start, s, True, needs), s) for s in group.backward]
    backward = [(es, s) for es, s in backward if any(n.any for n in needs[es.lo:es.hi])]
    backward_exec = [es for es, _ in backward]
    if channels.any:
        _check_channel_stages(forward + backward_exec)
    fwd_formats, bwd_formats = hand_off_formats(forward, backward_exec, needs, recipe)
    forward = [_with_output_format(st, f, nxt, "input")
               for st, f, nxt in zip(forward, fwd_formats, forward[1:] + [None])]
    backward_exec = [_with_output_format(st, f, nxt, "grad") for st, f, nxt
                     in zip(backward_exec, bwd_formats, backward_exec[1:] + [None])]
    wgrad_stages, wgrad_kept = (), ()
    if conditions.split_backward:
        backward_exec, wgrad_stages, wgrad_kept = split_lanes(
            backward_exec, [s for _, s in backward], needs, recipe, ops)
    slots = scaling_states(ops, recipe, conditions.device_type)
    idle = tuple(OperationContext(idle_needs(op), recipe) for op in ops)
    producers = [i for i, op in enumerate(ops) for _ in range(op.num_extra_outputs)]
    producers = [producers[slot] for slot in channels.caller_out]  # of the caller's
    constant = tuple(j for j, i in enumerate(producers) if not needs[i].input)
    in_place = _in_place_extra_inputs(ops)
    owners = [(op, name) for op in ops for name in op.param_names]
    needed = [p for n in needs for p in n.params]
    main = tuple(k for k, (op, name) in enumerate(owners)
                 if needed[k] and name in op.main_grad_params)
    return ExecPlan(group, ops, tuple(forward), tuple(backward_exec), needs,
                    any(n.any for n in needs), needs[0].input if needs else False,
                    len(owners), len(channels.caller_in), idle, constant,
                    tuple(stage for _, stage in backward), recipe, main_grad_params=main,
                    main_grad_owners=tuple(owners[k] for k in main),
                    in_place_extra_inputs=tuple(j for j, _ in in_place),
                    in_place_ops=tuple(op for _, op in in_place),
                    channels=channels if channels.any else None,
                    saved_readers=_saved_readers(ops, start, group.forward),
                    state_slots=slots,
                    state_sizes=tuple(recipe.role_format(role).scaling.state_size
                                      for _, role in slots),
                    wgrad_stages=wgrad_stages, wgrad_kept=wgrad_kept)


class WgradTarget:
    """Where a deferred wgrad goes: the split stage (``stage``, set once it is built) of
    a group whose ops are ``ops``; named by its token in compiled graphs."""

    def __init__(self, ops: tuple):
        self.ops = ops
        self.stage: Optional[ExecStage] = None
        self.token = tokens.register(self)

    def params(self) -> list:
        """The parameters of the stage's ops, read afresh (they may have been swapped)."""
        st = self.stage
        if st is None:
            raise RuntimeError("a WgradTarget is used before its stage is set")
        return [op.param(name) for op in self.ops[st.lo:st.hi] for name in op.param_names]


def split_lanes(stages: list, public: list, needs: tuple, recipe, ops: tuple) -> tuple:
    """``(backward stages, wgrad lane's Stages, (Stage, reason) kept whole)``: each stage
    whose parameters need gradients split into its dgrad stage and a deferred wgrad
    stage, where it can (``deferred_params``)."""
    out, lane, kept = [], [], []
    for st, stage in zip(stages, public):
        wanted = st.grad_mask[1] if st.num_params else ()
        if not any(wanted):
            out.append(st)
            continue
        verdict = _deferral(st, needs, recipe)
        if isinstance(verdict, str):
            kept.append((stage, verdict))
            out.append(st)
            continue
        deferred = tuple(bool(d and w) for d, w in zip(verdict, wanted))
        if not any(deferred):
            kept.append((stage, f"{stage.name} defers none of the gradients it computes"))
            out.append(st)
            continue
        out.append(_split_stage(st, deferred, ops))
        lane.append(attrs.evolve(stage, direction="wgrad"))
    return out, tuple(lane), tuple(kept)


def _deferral(st: ExecStage, needs: tuple, recipe) -> "tuple | str":
    """The stage's ``deferred_params``, or why its backward cannot split."""
    if recipe is not None and recipe.stateful:
        return (f"under {recipe.name} scaling each cast records into an amax history, "
                f"which a deferred wgrad would record out of order")
    verdict = st.op.deferred_params(recipe, needs[st.lo:st.hi])
    if not isinstance(verdict, str) and len(verdict) != st.num_params:
        raise TypeError(f"{type(st.op).__name__}.deferred_params returned {len(verdict)} flags "
                        f"for the stage's {st.num_params} parameters")
    return verdict


def _split_stage(st: ExecStage, deferred: tuple, ops: tuple) -> ExecStage:
    """``st`` as a dgrad stage whose ``deferred`` parameter gradients go to the wgrad lane."""
    cls = st.op.__class__
    dgrad = cls.dgrad_compute
    if cls.quantizes_own_output and st.output_format is not None and not st.output_format.stateful:
        fmt = st.output_format
        dgrad = functools.partial(dgrad, output_format=fmt if fmt.kernel_cast else None)
    target = WgradTarget(ops)
    main = tuple(name in op.main_grad_params for op in st.ops for name in op.param_names)
    st = attrs.evolve(st, deferred=deferred, dgrad=dgrad, wgrad=cls.wgrad_compute,
                      target=target, into_main_grad=main)
    target.stage = st
    return st


def state_owners(ops, recipe) -> tuple:
    """``(op index, role)`` of every FP8 state the ops keep under ``recipe`` (none unless
    its formats are stateful), in the order the runner passes them."""
    if recipe is None or not recipe.stateful:
        return ()
    return tuple((i, role) for i, op in enumerate(ops) for role in op.scaling_state_roles)


def scaling_states(ops, recipe, device_type: str) -> tuple:
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


def _saved_readers(ops, start, forward) -> tuple:
    """Per op: ``(op, reader, record type)``: the op and its ``saved_type``, but for the
    ops of a joint fusion, which saves its own record in its first op's context only."""
    readers = [(op, type(op).__name__, op.saved_type) for op in ops]
    for stage in forward:
        if stage.fused and stage.op.direction == "both":
            lo = stage.indices[0] - start
            for k in range(len(stage.indices)):
                what = stage.op.saved_type if k == 0 else None
                readers[lo + k] = (ops[lo + k], f"the joint fusion {stage.name}", what)
    return tuple(readers)


def _check_channel_stages(stages) -> None:
    """A stage may not cover both the writer and a reader of a channel: the executor
    passes channels between stages, never inside one."""
    for st in stages:
        written = {channel_of(op) for op in st.ops if op.num_extra_outputs} - {None}
        read = {channel_of(op) for op in st.ops if op.num_extra_inputs} - {None}
        if written & read:
            raise ValueError(f"the stage {st.provenance} covers both the writer and a reader of "
                             f"channel {sorted(written & read)[0]!r}: a fusion cannot pass a "
                             f"channel on inside itself")


def _in_place_extra_inputs(ops) -> list:
    """``(extra input index, op)`` of the ops that write into their extra input (an
    ``in_place`` attribute); each must be the group's last op: its output is that extra
    input, which autograd must see returned as the group's output."""
    found, position = [], 0  # position: among the extra inputs the caller passes
    for i, op in enumerate(ops):
        if channel_of(op):  # a channel's reader takes none of the caller's
            continue
        if op.num_extra_inputs and getattr(op, "in_place", False):
            if i != len(ops) - 1:
                raise ValueError(f"{op.describe()} at [{i}] writes the sum into its extra "
                                 f"input, which becomes the output: it must be the last op "
                                 f"of its Sequential; put the ops after it in another one")
            found.append((position, op))
        position += op.num_extra_inputs
    return found


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


def _exec_stage(ops, start, stage, backward: bool, op_needs: tuple) -> ExecStage:
    lo, hi = stage.indices[0] - start, stage.indices[-1] + 1 - start

    def span(count):
        a = sum(count(op) for op in ops[:lo])
        return slice(a, a + sum(count(op) for op in ops[lo:hi]))

    cls = stage.op.__class__  # a lone op's proxy reports its op's class
    compute = cls.backward_compute if backward else cls.forward_compute
    provenance = (f"{stage.name} {list(stage.indices)}: "
                  + " + ".join(op.describe() for op in ops[lo:hi]))
    mask: tuple = ()
    if backward:
        needs = op_needs[lo:hi]
        mask = (needs[0].input, tuple(p for n in needs for p in n.params),
                tuple(e for n in needs for e in n.extra_inputs))
    sync, offset = [], 0
    for op in ops[lo:hi] if backward else ():
        tp = op.grad_reduction()
        sync += [(offset + k, tp) for k in range(len(op.param_names))] if tp else []
        offset += len(op.param_names)
    return ExecStage(stage.op, ops[lo:hi], lo, hi, span(lambda op: op.num_extra_inputs),
                     span(lambda op: op.num_extra_outputs), span(lambda op: len(op.param_names)),
                     compute, provenance, mask, grad_sync=tuple(sync))


def _with_output_format(stage: ExecStage, fmt, consumer, role: str) -> ExecStage:
    if fmt is None:
        return stage
    if fmt.stateful:  # bound to the consumer's state at each call (executor)
        return attrs.evolve(stage, output_format=fmt,
                            output_state=_state_owner(consumer, role))
    compute = stage.compute
    if stage.op.__class__.quantizes_own_output:  # formats its kernels write; else cast after
        compute = functools.partial(compute, output_format=fmt if fmt.kernel_cast else None)
    return attrs.evolve(stage, output_format=fmt, compute=compute)
