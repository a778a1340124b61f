import pathlib
import sys

import attrs
import pytest
import torch

import fusible
from fusible.core import schema
from fusible.runtime import deferred, wgrad
from fusible.testing import reference

# The examples are documentation that tests import.
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    # a failed split-backward test leaves no pending wgrad to the next test's forwards
    deferred.drain()
    wgrad._taken.clear()


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def dtype(request):
    return request.param


@pytest.fixture
def fresh_dynamo():
    """For tests that compile new models of the same classes: start with no cache."""
    torch._dynamo.reset()
    yield


@pytest.fixture
def cuda_graph_recordings(monkeypatch):
    """The functions cudagraph trees (``mode="reduce-overhead"``) records from now on, one
    entry per recording."""
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager
    recorded, record = [], CUDAGraphTreeManager.record_function

    def spy(self, *args, **kwargs):
        recorded.append(args[-1] if args else kwargs)
        return record(self, *args, **kwargs)

    monkeypatch.setattr(CUDAGraphTreeManager, "record_function", spy)
    return recorded


@attrs.frozen
class Registries:
    """What the plugin registries hold: fusions (in planning order), recipes, the types
    that cross custom ops, the FP64 references of ops."""

    fusions: tuple
    recipes: dict
    schema_types: dict
    references: dict

    @classmethod
    def now(cls) -> "Registries":
        # the schema types and references have no public listing: read where they live
        return cls(fusible.registered_fusions(), fusible.registered_recipes(),
                   dict(schema._ADAPTERS), dict(reference._REFERENCES))

    def restore(self) -> None:
        """Back to these registries: what was registered since is removed, what was
        removed comes back (fusions in their planning order)."""
        if fusible.registered_fusions() != self.fusions:
            for cls in fusible.registered_fusions():
                fusible.unregister_fusion(cls)
            for cls in self.fusions:  # registered in planning order, they plan in it
                fusible.register_fusion(cls)
        for name, cls in fusible.registered_recipes().items():
            if self.recipes.get(name) is not cls:
                fusible.unregister_recipe(cls)
        for cls in self.recipes.values():
            fusible.register_recipe(cls)
        for now, then in ((schema._ADAPTERS, self.schema_types),
                          (reference._REFERENCES, self.references)):
            if now != then:
                now.clear()
                now.update(then)


class Plugins:
    """Registrations for one test (the ``plugins`` fixture), undone after it."""

    fusion = staticmethod(fusible.register_fusion)
    recipe = staticmethod(fusible.register_recipe)
    schema_type = staticmethod(fusible.register_schema_type)
    reference = staticmethod(reference.register_reference)


@pytest.fixture
def plugins():
    """For a test that registers plugins (fusions, recipes, schema types, references),
    through this object's methods, by hand, or by running code that registers (an
    example, a doc page), or that unregisters built-ins: the registries are restored
    after it."""
    before = Registries.now()
    yield Plugins()
    before.restore()


@pytest.fixture(autouse=True)
def _registries_unchanged(request):
    """A test that changes the registries without the ``plugins`` fixture fails (and they
    are restored): no registration leaks into later tests."""
    before = Registries.now()
    yield
    if Registries.now() != before:
        before.restore()
        pytest.fail(f"{request.node.nodeid} changed the plugin registries: request the "
                    f"plugins fixture, which undoes it", pytrace=False)


@pytest.fixture
def broken_plugin(monkeypatch):
    """``install(registry_state, wanted, value)``: the entry-point group ``wanted`` advertises
    one plugin, ``broken = value``, that fails to import, and the registry whose loading
    state is ``registry_state`` loads its plugins again."""
    import importlib.metadata

    def install(registry_state: dict, wanted: str, value: str) -> None:
        class Broken:
            name = "broken"

            def load(self):
                raise ImportError("no module named nowhere")

        Broken.value = value
        monkeypatch.setitem(registry_state, "loaded", False)
        monkeypatch.setattr(importlib.metadata, "entry_points",
                            lambda group: [Broken()] if group == wanted else [])

    return install
