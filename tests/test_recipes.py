"""FP8 recipes as plugins: the registry, presets, and a recipe written outside fusible
running a model eagerly and compiled."""

import importlib.metadata
import re
from typing import ClassVar

import attrs
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fusible
from fusible import ops
from fusible.quantization.recipes import base as recipe_base
from fusible.testing import snr_db

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
E4M3 = torch.float8_e4m3fn
# fusible's own recipes: the entry points of its distribution (pyproject.toml)
BUILT_IN = sorted((ep for ep in importlib.metadata.distribution("fusible").entry_points
                   if ep.group == "fusible.recipes"), key=lambda ep: ep.name)
PRESETS = sorted(preset for cls in fusible.registered_recipes().values()
                 for preset in cls.presets)


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
def plugin(plugins):
    return plugins.recipe(AllE4M3)


@pytest.mark.parametrize("entry_point", BUILT_IN, ids=lambda ep: ep.name)
def test_a_built_in_recipe_is_registered_by_its_entry_point_with_its_presets(entry_point):
    cls = entry_point.load()
    assert cls.name == entry_point.name and fusible.registered_recipes()[cls.name] is cls
    assert fusible.recipe_from_name(cls.name) == cls()
    for preset, settings in cls.presets.items():
        assert fusible.recipe_from_name(preset) == cls(**settings)


def test_the_recipe_classes_fusible_exports_are_registered():
    exported = {v for v in vars(fusible).values()
                if isinstance(v, type) and issubclass(v, fusible.Recipe) and v.name}
    assert exported and exported <= set(fusible.registered_recipes().values())
    assert fusible.recipe_from_name("tensorwise_e4m3") == fusible.Float8CurrentScaling("e4m3")


def test_an_unknown_recipe_name_lists_the_recipes_and_presets():
    known = sorted({*fusible.registered_recipes(), *PRESETS})
    assert {"tensorwise", "tensorwise_e4m3"} <= set(known)
    with pytest.raises(ValueError, match=re.escape(f"no recipe or preset named 'rowwize'; "
                                                   f"known: {', '.join(known)}")):
        fusible.recipe_from_name("rowwize")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_a_model_in_fp8(preset):
    """Each preset's recipe plans FP8 GEMMs for a tiny MLP, whose output and gradients
    stay within FP8's reach of float64 (23-36 dB per tensor, the floor 20; a delayed
    recipe's first step casts with scale 1)."""
    recipe = fusible.recipe_from_name(preset)
    model = ops.Sequential(ops.Linear(32, 64), ops.GELU(), ops.Linear(64, 32)).bfloat16()
    reference = ops.Sequential(ops.Linear(32, 64), ops.GELU(), ops.Linear(64, 32)).double()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(32, 32)
    with fusible.autocast(recipe=recipe):
        assert fusible.plan_model(model, x.bfloat16()).totals()["FP8 GEMMs"] == 2
    results = []
    for m, dtype, fp8 in ((model, torch.bfloat16, True), (reference, torch.float64, False)):
        xx = x.to(dtype).requires_grad_()
        with fusible.autocast(enabled=fp8, recipe=recipe):
            y = m(xx)
        y.backward(torch.ones_like(y))
        results.append([y.detach(), xx.grad, *(p.grad for p in m.parameters())])
    for got, want in zip(*results):
        assert snr_db(got, want) > 20, preset


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
    assert AllE4M3().key == f"test_all_e4m3(gemm_policy={AllE4M3().gemm_policy!r})"
    assert AllE4M3().key != builtin.key
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    for recipe in (builtin, AllE4M3(), AllE4M3()):
        assert all(torch.equal(a, b) for a, b in zip(step(compiled, recipe), want))
    assert counter.frame_count == 2  # one graph per recipe


def test_registration_errors_name_the_classes(plugins, plugin):
    @attrs.frozen
    class Twin(fusible.Recipe):
        name: ClassVar[str] = "test_all_e4m3"

    with pytest.raises(ValueError, match=r"name 'test_all_e4m3' of .*Twin is taken by "
                                         r".*AllE4M3"):
        plugins.recipe(Twin)

    @attrs.frozen
    class PresetClash(fusible.Recipe):
        name: ClassVar[str] = "test_preset_clash"
        presets: ClassVar[dict] = {"tensorwise": {}}

    with pytest.raises(ValueError, match=r"preset 'tensorwise' of .*PresetClash is taken by "
                                         r".*Float8CurrentScaling"):
        plugins.recipe(PresetClash)

    class NotAttrs(fusible.Recipe):
        name = "test_not_attrs"

    with pytest.raises(TypeError, match="not an attrs class derived from fusible.Recipe"):
        plugins.recipe(NotAttrs)

    @attrs.frozen
    class Nameless(fusible.Recipe):
        pass

    with pytest.raises(ValueError, match="Nameless needs a name"):
        plugins.recipe(Nameless)


def test_autocast_refuses_an_unregistered_recipe():
    """Keys map back to recipes: an unregistered class could share a name and a key."""
    names = ", ".join(sorted(fusible.registered_recipes()))
    with pytest.raises(TypeError, match=re.escape(f"registered recipe class ({names}; a new "
                                                  f"one registers with "
                                                  f"fusible.register_recipe)")):
        with fusible.autocast(recipe=AllE4M3()):
            pass


def test_a_recipe_plugin_failing_to_load_says_which(broken_plugin):
    broken_plugin(recipe_base._state, "fusible.recipes", "nowhere:Recipe")
    for _ in range(2):  # and again: nothing is skipped silently later
        with pytest.raises(RuntimeError, match=r"recipe plugin 'broken' \(nowhere:Recipe\) of "
                                               r"entry-point group 'fusible.recipes' failed"):
            fusible.recipe_from_name("tensorwise")
