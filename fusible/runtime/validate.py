"""Checking a group's inputs before its stages run: every op sees the shape, dtype and
device it will get (once per input signature)."""

from __future__ import annotations

from fusible.core.operation import params_given
from fusible.planning.exec_plan import ExecPlan
from fusible.planning.features.channels import channel_of, write_channel_of


def validate(plan: ExecPlan, x, extra_inputs, cache: bool = True, params=None) -> None:
    """Let every op check the shape, dtype and device it will see (once per signature).

    Shapes are inferred op by op, so ops inside a fused stage are checked too; under an
    FP8 recipe each op also checks the shape against the recipe (``validate_fp8``).
    ``params``: the ops' parameters as the call has them (a compiled group's, which the
    ops then check rather than their attributes: :func:`params_given`).
    """
    if params is not None:
        with params_given(plan.ops, params):
            return validate(plan, x, extra_inputs, cache)
    if cache:
        signature = (x.shape, x.device, *[(e.shape, e.dtype, e.device) for e in extra_inputs])
        if signature in plan.validated:
            return
    shape, pos, written = tuple(x.shape), 0, {}
    named = plan.features.channels is not None
    recipes = dict(zip(map(id, plan.ops), plan.recipes()))
    for st in plan.forward:
        for op in st.ops:
            k, name = op.num_extra_inputs, named and channel_of(op)
            recipe = recipes.get(id(op), plan.recipe)
            if recipe is not None:
                op.validate_fp8(shape, recipe)
            if named and op.num_extra_outputs and write_channel_of(op):
                written[write_channel_of(op)] = shape
            if name and k:  # the channel's tensor: of the shape where it was written
                extras = (x.new_empty(()).expand(written[name]),) * k
            else:
                extras, pos = extra_inputs[pos:pos + k], pos + k
            shape = op.validate(shape, x.dtype, x.device, extras)
    if cache:
        if len(plan.validated) > 256:  # many distinct shapes: keep the cache small
            plan.validated.clear()
        plan.validated[signature] = True
