"""fusible.capture_step: what a CUDA graph cannot replay is refused before capture, naming
the op (checked here on the CPU, where the check runs the same); the capture and its
replays against eager steps, bit for bit, are in tests/test_cuda.py."""

import pytest
import torch

import fusible
from fusible import ops
from fusible.runtime.captured_step import CaptureCheck, as_if_capturing


def _model():
    torch.manual_seed(0)
    return ops.Sequential(ops.LayerNorm(16), ops.Linear(16, 32), ops.GELU(), ops.Linear(32, 16))


def _steps(model, optimizer):
    def plain(x):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def logs(x):
        loss = plain(x)
        print(f"loss {loss.item():.3f}")  # a host synchronisation
        return loss

    def filters(x):
        return plain(x[x[:, 0] > 0])  # a data-dependent shape

    return plain, logs, filters


def test_the_check_passes_a_training_step_and_names_what_a_graph_cannot_replay():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)  # no host step
    plain, logs, filters = _steps(model, optimizer)
    x = torch.randn(8, 16)
    with CaptureCheck():
        plain(x)  # fusible's stages, autograd, the optimizer: all replayable
    with pytest.raises(fusible.UncapturableError, match="_local_scalar_dense.*reads a device "
                                                         "value on the host.*called at .*"
                                                         r"test_captured_step.py:\d+ \(print"):
        with CaptureCheck():
            logs(x)
    with pytest.raises(fusible.UncapturableError, match="index.Tensor.*shape depends on the values"):
        with CaptureCheck():
            filters(x)


def test_capture_step_refuses_before_capturing():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain, _, _ = _steps(model, optimizer)
    with pytest.raises(ValueError, match=r"CUDA graphs need CUDA tensor inputs, got \['cpu'\]"):
        fusible.capture_step(plain, torch.randn(8, 16))
    with pytest.raises(fusible.UncapturableError, match="AdamW counts its steps on the host: "
                                                         "build it with capturable=True"):
        fusible.capture_step(plain, torch.randn(8, 16), optimizers=[optimizer])


def test_the_check_run_takes_the_paths_a_capture_takes():
    """Code that synchronises only outside a capture (transformers' packed-sequence check
    of a training call's positions does) passes: the check run sees
    torch.cuda.is_current_stream_capturing() as True, as the capture will. A converted
    Hugging Face model's training step passes it, its fused layers running."""
    pytest.importorskip("transformers")
    from test_convert_layers import _model
    model = _model("llama")
    fusible.convert(model)
    ids = torch.randint(0, 96, (2, 8))
    original = torch.cuda.is_current_stream_capturing
    with CaptureCheck(), as_if_capturing():
        model(input_ids=ids, labels=ids).loss.backward()
    assert all(not layer.forward.fallbacks for layer in model.model.layers)
    assert torch.cuda.is_current_stream_capturing is original  # restored

    def sync_outside_capture(x):
        try:
            capturing = torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU build of PyTorch
            capturing = False
        if not capturing:
            x.sum().item()
        return x * 2
    with CaptureCheck(), as_if_capturing():
        sync_outside_capture(torch.ones(2))
    with pytest.raises(fusible.UncapturableError, match=r"called at .*x\.sum\(\)\.item\(\)"):
        with CaptureCheck():
            sync_outside_capture(torch.ones(2))


def test_the_pretended_capture_is_this_threads_only():
    """Another thread sees the real answer while a check runs, and the function is
    restored after blocks opened in two threads close in any order."""
    import threading
    original = torch.cuda.is_current_stream_capturing
    seen, opened, release = [], threading.Event(), threading.Event()

    def other():
        with as_if_capturing():
            opened.set()
            release.wait(10)

    worker = threading.Thread(target=other)
    worker.start()
    opened.wait(10)
    with as_if_capturing():
        assert torch.cuda.is_current_stream_capturing()
        probe = threading.Thread(target=lambda: seen.append(
            torch.cuda.is_current_stream_capturing is original or _real_answer()))
        probe.start()
        probe.join()
    release.set()
    worker.join()
    assert seen == [False]
    assert torch.cuda.is_current_stream_capturing is original


def _real_answer() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU build of PyTorch
        return False


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_check_run_runs_a_compiled_step_s_python():
    """Compiled steps run their Python in the check run (set_stance force_eager): dynamo
    cannot trace under the check's dispatch mode (PyTorch 2.13 skips each frame and tries
    the ones inside, planning code included: a fullgraph function raises), and the check
    sees the ops inside fusible's stages, not their custom ops; the step is not compiled
    again for the check."""
    from torch._dynamo.utils import counters
    from fusible.runtime.captured_step import _eagerly
    model = _model()
    compiled = torch.compile(lambda x: model(x).square().mean(), backend="aot_eager",
                             fullgraph=True)
    x = torch.randn(8, 16)
    compiled(x)
    graphs = counters["stats"]["unique_graphs"]

    class Seen(CaptureCheck):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(str(func))
            return super().__torch_dispatch__(func, types, args, kwargs)

    names: list = []
    with Seen(), as_if_capturing(), _eagerly():
        compiled(x)
    assert names and not any(n.startswith("fusible.") for n in names)
    assert "aten.addmm.default" in names  # a stage's GEMM
    assert counters["stats"]["unique_graphs"] == graphs
