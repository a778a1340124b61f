"""Preparing a group's plan for execution: the core stages (slices, gradient masks, FP8
hand-off formats), then each execution feature's pass (``planning/features``)."""

from __future__ import annotations

import functools

import attrs

from fusible.core.conditions import PlanConditions
from fusible.planning.exec_plan import ExecPlan, ExecStage, Preparation
from fusible.planning.features import attach_features
from fusible.planning.features.channels import caller_slots
from fusible.planning.passes import (check_gated_layouts, check_sequence_parallel,
                                     hand_off_formats, op_grad_needs)
from fusible.planning.planner import PlanEnvironment, plan_group
from fusible.quantization.gemm_policy import gemm_decision


def prepare_group(ops: tuple, start: int, conditions: PlanConditions, recipe) -> ExecPlan:
    """Plan a group of ``ops`` (the first at ``start``) for the group's ``conditions``;
    ``recipe`` is the FP8 recipe those conditions name (``conditions.recipe_key``)."""
    needs = op_grad_needs(ops, conditions)
    recipe, op_recipes = gemm_recipes(ops, conditions, recipe)
    env = PlanEnvironment(conditions, {start + i: n for i, n in enumerate(needs)}, recipe,
                          {start + i: r for i, r in enumerate(op_recipes)})
    check_sequence_parallel(ops)
    check_gated_layouts(ops)
    group = plan_group(ops, start, env)
    forward = [_exec_stage(ops, start, s, False, needs) for s in group.forward]
    backward = [(_exec_stage(ops, start, s, True, needs), s) for s in group.backward]
    backward = [(es, s) for es, s in backward if any(n.any for n in needs[es.lo:es.hi])]
    backward_exec = [es for es, _ in backward]
    fwd_formats, bwd_formats = hand_off_formats(forward, backward_exec, needs, op_recipes)
    forward = [_with_output_format(st, f) for st, f in zip(forward, fwd_formats)]
    backward_exec = [_with_output_format(st, f) for st, f in zip(backward_exec, bwd_formats)]
    public = tuple(stage for _, stage in backward)
    prep = Preparation(ops, start, conditions, recipe, needs, tuple(forward),
                       tuple(backward_exec), public, op_recipes)
    features = attach_features(prep)
    caller_in, caller_out = caller_slots(ops, features.channels)
    return ExecPlan(group, ops, prep.forward, prep.backward, public, needs, recipe,
                    _saved_readers(ops, start, group.forward), len(caller_in),
                    _constant_extra_outputs(ops, needs, caller_out), features, op_recipes)


def gemm_recipes(ops: tuple, conditions: PlanConditions, recipe) -> tuple:
    """``(group recipe, per-op recipes)`` under the recipe's GEMM policy
    (:mod:`fusible.quantization.gemm_policy`): each op computes under ``recipe`` but a GEMM
    the policy (or its ``fp8`` attribute) keeps in high precision, under None; where every
    op that would quantize is kept so, the group plans as without a recipe (the bf16
    plan, its fusions and no casts)."""
    if recipe is None:
        return None, (None,) * len(ops)
    op_recipes = tuple(None if gemm_decision(recipe, op, conditions.device_type) else recipe
                       for op in ops)
    kept = [r is None for op, r in zip(ops, op_recipes) if _quantizes(op, recipe)]
    if kept and all(kept):
        return None, (None,) * len(ops)
    return recipe, op_recipes


def _quantizes(op, recipe) -> bool:
    return op.quantizes(recipe, "forward") or op.quantizes(recipe, "backward")


def _constant_extra_outputs(ops, needs: tuple, caller_out: tuple) -> tuple:
    """The caller's extra outputs that depend on nothing requiring grad."""
    producers = [i for i, op in enumerate(ops) for _ in range(op.num_extra_outputs)]
    producers = [producers[slot] for slot in caller_out]
    return tuple(j for j, i in enumerate(producers) if not needs[i].input)


def _saved_readers(ops, start, forward) -> tuple:
    """Per op: ``(op, reader, record type, fields the reader may overwrite)``: the op and
    its ``saved_type``, but for the ops of a joint fusion, which saves its own record in
    its first op's context only (and may consume fields of it: ``consumable_saved``)."""
    readers = [(op, type(op).__name__, op.saved_type, ()) for op in ops]
    for stage in forward:
        if stage.fused and stage.op.direction == "both":
            lo = stage.indices[0] - start
            for k in range(len(stage.indices)):
                what, consumable = ((stage.op.saved_type, stage.op.consumable_saved) if k == 0
                                    else (None, ()))
                readers[lo + k] = (ops[lo + k], f"the joint fusion {stage.name}", what,
                                   consumable)
    return tuple(readers)


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
    return ExecStage(stage.op, ops[lo:hi], lo, hi, span(lambda op: op.num_extra_inputs),
                     span(lambda op: op.num_extra_outputs), span(lambda op: len(op.param_names)),
                     compute, provenance, mask)


def _with_output_format(stage: ExecStage, fmt) -> ExecStage:
    """``stage`` handing its result on in ``fmt``; a value format is bound into the compute
    of an op that writes it (a stateful one is bound at each call: scaling states)."""
    if fmt is None:
        return stage
    compute = stage.compute
    if stage.op.__class__.quantizes_own_output and not fmt.stateful:
        compute = functools.partial(compute, output_format=fmt if fmt.kernel_cast else None)
    return attrs.evolve(stage, output_format=fmt, compute=compute)
