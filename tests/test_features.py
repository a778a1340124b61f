"""Execution features: each is a record on the plan, a planning pass and a runtime module,
and a plan carries exactly the records of the features its group uses."""

import importlib
import pathlib

import attrs
import pytest
import torch

import fusible
from fusible import ops
from fusible.core.conditions import PlanConditions
from fusible.planning.features import Features
from fusible.quantization.recipes.autocast import current_key
from fusible.runtime.features import RUNTIME
from fusible.runtime.layout import layout_of
from fusible.testing import exact_tensor

ROOT = pathlib.Path(__file__).parent.parent / "fusible"
FIELDS = [f.name for f in attrs.fields(Features)]


def _modules(folder: str) -> set:
    return {p.stem for p in (ROOT / folder).glob("*.py")} - {"__init__", "base"}


def test_every_feature_is_a_record_a_pass_and_a_runtime_module():
    assert _modules("planning/features") == set(FIELDS) == _modules("runtime/features")
    for name in FIELDS:
        planning = importlib.import_module(f"fusible.planning.features.{name}")
        assert callable(planning.attach)
        assert RUNTIME[name].name == name
        assert RUNTIME[name] is importlib.import_module(f"fusible.runtime.features.{name}").FEATURE


def _exec_plan(model, x, *extras):
    """The group's prepared plan for a call on ``x`` (a model of one group)."""
    runner = layout_of(model).single
    key = PlanConditions.of(x, runner.params.read(), extras,
                            current_key(), model.training)
    return runner.lookup(key, fusible.quantization.fp8_recipe())


def _active(model, x, *extras) -> list:
    return [name for name, _ in _exec_plan(model, x, *extras).features.active()]


def test_a_plan_without_features_binds_no_hooks():
    model = ops.Sequential(ops.Linear(16, 32), ops.GELU(), ops.Linear(32, 16))
    x = torch.randn(4, 16, requires_grad=True)
    plan = _exec_plan(model, x)
    hooks = plan.hooks
    assert plan.features.active() == []
    assert hooks.begin_forward == hooks.end_forward == hooks.forward_node == ()
    assert hooks.begin_backward == hooks.end_backward == hooks.tensors == ()
    assert set(hooks.forward) == set(hooks.backward) == {None} and not hooks.active


def test_a_plan_holds_the_records_of_the_features_its_group_uses():
    x = torch.randn(4, 16, requires_grad=True)
    channel = ops.Sequential(ops.MakeExtraOutput(channel="r"), ops.Linear(16, 16),
                             ops.AddExtraInput(channel="r"))
    assert _active(channel, x) == ["channels"]
    in_place = ops.Sequential(ops.Linear(16, 16), ops.AddExtraInput(in_place=True))
    assert _active(in_place, x, torch.randn(4, 16)) == ["in_place"]
    main = ops.Sequential(ops.Linear(16, 16, accumulate_into_main_grad=True))
    assert _active(main, x) == ["main_grad"]
    with torch.no_grad():  # no gradient, no main_grad buffer read
        assert _active(main, x) == []
    delayed = ops.Sequential(ops.Linear(16, 16))
    with fusible.autocast(recipe=fusible.DelayedScaling()):
        assert _active(delayed, x) == ["scaling_states"]
    with fusible.autocast():
        assert _active(delayed, x) == []
    with fusible.split_backward():
        assert _active(delayed, x) == ["split_backward"]


def test_stage_ranges_name_each_eager_stage_in_profiles(monkeypatch):
    """The feature written as the proof of the layout: one pass, one runtime module, one
    field. Read when a plan is made."""
    monkeypatch.setenv("FUSIBLE_STAGE_RANGES", "1")
    model = ops.Sequential(ops.Linear(16, 32), ops.GELU(), ops.Linear(32, 16))
    x = exact_tensor((4, 16)).requires_grad_()
    assert _active(model, x) == ["stage_ranges"]
    with torch.profiler.profile() as prof:
        y = model(x)
        y.sum().backward()
    names = [e.name for e in prof.events() if e.name.startswith("fusible ")]
    assert names == ["fusible ForwardLinearBias [0, 1]: BasicLinear(in_features=16, "
                     "out_features=32) + Bias(size=32)",
                     "fusible GELU [2]: GELU(approximate='none')",
                     "fusible ForwardLinearBias [3, 4]: BasicLinear(in_features=32, "
                     "out_features=16) + Bias(size=16)",
                     "fusible BackwardLinearBias [3, 4]: BasicLinear(in_features=32, "
                     "out_features=16) + Bias(size=16) (backward)",
                     "fusible BackwardActivationBias [1, 2]: Bias(size=32) + "
                     "GELU(approximate='none') (backward)",
                     "fusible BasicLinear [0]: BasicLinear(in_features=16, out_features=32) "
                     "(backward)"]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), y)  # compiled stages are named custom ops already
    monkeypatch.delenv("FUSIBLE_STAGE_RANGES")
    assert _active(ops.Sequential(ops.Linear(16, 16)), x) == []


class _StatefulTaker(ops.Identity):
    """A parameterless op that asks for its input in the recipe's format, and keeps no
    FP8 state of its own."""

    def input_format(self, recipe, needs):
        return recipe.input_format()


def test_a_stateful_hand_off_without_an_owner_is_refused_when_planned():
    """Under delayed scaling the stage before must cast with the taker's input state: a
    taker that keeps none is an error naming it, when the plan is made."""
    model = ops.Sequential(ops.GELU(), _StatefulTaker())
    x = torch.randn(16, 16, requires_grad=True)
    with fusible.autocast(recipe=fusible.DelayedScaling()):
        with pytest.raises(ValueError, match=r"the stage _StatefulTaker \[1\].* asks for its "
                                             r"input in a stateful FP8 format.* covers 0"):
            model.plan(x)


def test_a_plan_is_made_for_the_recipe_its_key_names():
    model = ops.Sequential(ops.Linear(16, 16))
    x = torch.randn(4, 16)
    runner = layout_of(model).single
    key = PlanConditions.of(x, runner.params.read(), (), fusible.Float8CurrentScaling().key,
                            True)
    with pytest.raises(RuntimeError, match="planned for the FP8 recipe key"):
        runner.lookup(key, fusible.DelayedScaling())
