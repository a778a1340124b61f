"""The built-in fusions and recipes are plugins: each is an entry point of fusible's
installed distribution (pyproject.toml), found by scanning the packages that define them
rather than by a list, so a file whose entry point is missing fails here instead of
silently not loading."""

import importlib
import importlib.metadata
import inspect
import pkgutil

import pytest

import fusible
import fusible.fusions
import fusible.quantization

FUSIONS_GROUP, RECIPES_GROUP = "fusible.fusions", "fusible.recipes"  # docs/design.md


def _entry_points(group: str) -> list:
    """The entry points of ``group`` that fusible's own distribution advertises."""
    return [ep for ep in importlib.metadata.distribution("fusible").entry_points
            if ep.group == group]


def _modules(package) -> list:
    """Every module of ``package``, its subpackages' included (walked: no list to keep)."""
    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def _defined(modules: list, base: type) -> list:
    """The subclasses of ``base`` each module defines (not imports)."""
    return [cls for module in modules for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, base) and cls is not base and cls.__module__ == module.__name__]


def _not_advertised(classes: list, group: str) -> list:
    """The classes no entry point of ``group`` names, by itself or by its module (whose
    classes register themselves when it loads)."""
    advertised = {(ep.module, ep.attr) for ep in _entry_points(group)}
    return sorted(f"{cls.__module__}:{cls.__qualname__}" for cls in classes
                  if not {(cls.__module__, cls.__qualname__), (cls.__module__, None)}
                  & advertised)


FUSIONS = _defined(_modules(fusible.fusions), fusible.FusedOperation)
# a recipe the registry can take has a name (GranularityRecipe, a base, has none)
RECIPES = [cls for cls in _defined(_modules(fusible.quantization), fusible.Recipe) if cls.name]
REINSTALL = ("add it to pyproject.toml's entry points and reinstall (pip install -e ., or "
             "scripts/setup.sh)")


def test_the_scans_find_the_built_ins():
    assert {"ForwardLinearBias", "RecomputeNormLinear"} <= {c.__name__ for c in FUSIONS}
    assert {fusible.Float8CurrentScaling, fusible.DelayedScaling} <= set(RECIPES)


def test_every_fusion_of_fusions_is_an_entry_point():
    missing = _not_advertised(FUSIONS, FUSIONS_GROUP)
    assert not missing, f"fusions no entry point advertises: {missing}; {REINSTALL}"


def test_every_recipe_of_fusible_quantization_is_an_entry_point():
    missing = _not_advertised(RECIPES, RECIPES_GROUP)
    assert not missing, f"recipes no entry point advertises: {missing}; {REINSTALL}"


@pytest.mark.parametrize("entry_point", _entry_points(FUSIONS_GROUP), ids=lambda ep: ep.name)
def test_a_fusion_entry_point_loads_a_registered_fusion(entry_point):
    assert entry_point.load() in fusible.registered_fusions()

# A recipe entry point's class is registered under its name with its presets:
# tests/test_recipes.py.
