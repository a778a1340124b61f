import pathlib
import sys

import pytest
import torch

from fusible.quantization.gemm_policy import set_default_gemm_policy
from fusible.runtime import deferred
from plugin_registries import Plugins, Registries

# The suite checks FP8 on every GEMM, whatever its size: on the GPU the default policy
# would keep the small GEMMs of the tests in bf16 (tests/test_gemm_policy.py checks it)
set_default_gemm_policy(None)

# The examples are documentation that tests import.
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    # a failed split-backward test leaves no pending wgrad to the next test's forwards
    deferred.forget()


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
