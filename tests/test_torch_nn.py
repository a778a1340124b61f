"""fusible behaves like torch.nn where PyTorch users go (issue 11): one regression test (or
more) per point."""

import threading

import torch

import fusible
from fusible import ops
from fusible.testing import stage_names


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_autocast_is_thread_local():
    model = ops.Sequential(ops.Linear(32, 32))
    x = torch.randn(16, 32)

    def recipe_seen():
        return model.plan(x).conditions.recipe_key, fusible.quantization.fp8_recipe()

    with fusible.autocast():
        assert recipe_seen()[1] is not None
        assert _in_thread(recipe_seen) == (None, None)  # another thread keeps its own state
        with torch.no_grad():
            fp8 = model(x)
            plain = _in_thread(lambda: model(x))
    with torch.no_grad():
        assert torch.equal(plain, model(x)) and not torch.equal(fp8, plain)
    assert recipe_seen() == (None, None)


def test_autocast_in_a_thread_recompiles_there_only(fresh_dynamo):
    model = ops.Sequential(ops.Linear(32, 32))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(16, 32)
    with torch.no_grad():
        plain = compiled(x)

        def fp8_run():
            with fusible.autocast():
                return compiled(x)

        assert not torch.equal(_in_thread(fp8_run), plain)
        assert torch.equal(compiled(x), plain)
    assert stage_names(model.plan(x).forward) == ["ForwardLinearBias"]
