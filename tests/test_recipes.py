"""FP8 recipes as plugins: the registry, presets, and a recipe written outside fusible
running a model eagerly and compiled."""

from typing import ClassVar

import attrs
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fusible
from fusible import ops
from fusible.quantization.recipes import base as recipe_base

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
E4M3 = torch.float8_e4m3fn


@attrs.frozen
class AllE4M3(fusible.Recipe):
    """A plugin's recipe: E4M3 for every role, per tensor (what the built-in's "e4m3"
    format gives, through another class)."""

    name: ClassVar[str] = "test_all_e4m3"
    presets: ClassVar[dict] = {"test_all_e4m3_preset": {}}

    def input_format(self, columnwise=False):
        return fusible.Float8Format(E4M3, columnwise)

    weight_format = grad_format = input_format


@pytest.fixture
def plugin():
    fusible.register_recipe(AllE4M3)
    yield AllE4M3
    fusible.unregister_recipe(AllE4M3)


def test_the_built_in_recipe_is_an_entry_point_with_presets():
    assert fusible.registered_recipes()["tensorwise"] is fusible.Float8CurrentScaling
    assert fusible.recipe_from_name("tensorwise") == fusible.Float8CurrentScaling()
    assert fusible.recipe_from_name("tensorwise_e4m3") == fusible.Float8CurrentScaling("e4m3")
    assert fusible.registered_recipes()["rowwise"] is fusible.Float8RowwiseScaling
    assert fusible.registered_recipes()["blockwise"] is fusible.Float8BlockScaling
    assert fusible.recipe_from_name("mxfp8_hybrid") == fusible.MXFP8BlockScaling("hybrid")
    assert fusible.registered_recipes()["delayed"] is fusible.DelayedScaling
    with pytest.raises(ValueError, match=r"no recipe or preset named 'rowwize'; known: "
                                         r"blockwise, delayed, delayed_e4m3, mxfp8, "
                                         r"mxfp8_hybrid, rowwise, rowwise_hybrid, tensorwise, "
                                         r"tensorwise_e4m3"):
        fusible.recipe_from_name("rowwize")


def test_a_plugin_recipe_runs_a_model_like_the_same_formats_built_in(plugin):
    """Same formats, same bits; another recipe key, so switching re-plans (eagerly) and
    recompiles (compiled) rather than reusing the other recipe's plan."""
    assert fusible.recipe_from_name("test_all_e4m3_preset") == AllE4M3()
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(32, 64), ops.GELU(), ops.Linear(64, 32))
    x = torch.randn(16, 32)

    def step(m, recipe):
        xx = x.clone().requires_grad_()
        with fusible.autocast(recipe=recipe):
            y = m(xx)
        y.backward(torch.ones_like(y))
        grads = [xx.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return [y.detach()] + grads

    builtin = fusible.Float8CurrentScaling("e4m3")
    want = step(model, builtin)
    assert all(torch.equal(a, b) for a, b in zip(step(model, AllE4M3()), want))
    assert AllE4M3().key == "test_all_e4m3()" and AllE4M3().key != builtin.key
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for recipe in (builtin, AllE4M3(), AllE4M3()):
        assert all(torch.equal(a, b) for a, b in zip(step(compiled, recipe), want))
    assert counter.frame_count == 2  # one graph per recipe


def test_registration_errors_name_the_classes(plugin):
    @attrs.frozen
    class Twin(fusible.Recipe):
        name: ClassVar[str] = "test_all_e4m3"

    with pytest.raises(ValueError, match=r"name 'test_all_e4m3' of .*Twin is taken by "
                                         r".*AllE4M3"):
        fusible.register_recipe(Twin)

    @attrs.frozen
    class PresetClash(fusible.Recipe):
        name: ClassVar[str] = "test_preset_clash"
        presets: ClassVar[dict] = {"tensorwise": {}}

    with pytest.raises(ValueError, match=r"preset 'tensorwise' of .*PresetClash is taken by "
                                         r".*Float8CurrentScaling"):
        fusible.register_recipe(PresetClash)

    class NotAttrs(fusible.Recipe):
        name = "test_not_attrs"

    with pytest.raises(TypeError, match="not an attrs class derived from fusible.Recipe"):
        fusible.register_recipe(NotAttrs)

    @attrs.frozen
    class Nameless(fusible.Recipe):
        pass

    with pytest.raises(ValueError, match="Nameless needs a name"):
        fusible.register_recipe(Nameless)


def test_autocast_refuses_an_unregistered_recipe():
    """Keys map back to recipes: an unregistered class could share a name and a key."""
    with pytest.raises(TypeError, match=r"registered recipe class \(blockwise, delayed, mxfp8, "
                                        r"rowwise, tensorwise; a new "
                                        r"one registers with fusible.register_recipe\)"):
        with fusible.autocast(recipe=AllE4M3()):
            pass


def test_a_recipe_plugin_failing_to_load_says_which(broken_plugin):
    broken_plugin(recipe_base._state, "fusible.recipes", "nowhere:Recipe")
    for _ in range(2):  # and again: nothing is skipped silently later
        with pytest.raises(RuntimeError, match=r"recipe plugin 'broken' \(nowhere:Recipe\) of "
                                               r"entry-point group 'fusible.recipes' failed"):
            fusible.recipe_from_name("tensorwise")
