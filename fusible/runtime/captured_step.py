"""A whole training step as one CUDA graph: :func:`capture_step`.

The step is the user's own function (forward, loss, backward, the optimizer's step, the
gradients cleared), called on static input buffers: each replay copies the new batch into
them and replays every kernel of the step at once, so a small model's step costs no host
time per op. What the graph cannot replay is refused before capture, naming the op, by
running the step once under :class:`CaptureCheck`: a host synchronisation (``.item()``,
``bool()`` or ``print`` of a device value, a copy to the CPU), a result whose shape depends
on the values (``nonzero``, ``masked_select``, ``unique``), a CPU tensor beside CUDA ones
(host memory is read at capture, never again), and an optimizer that keeps its step count
on the host (it needs ``capturable=True``); a boolean mask as an index selects a
data-dependent number of rows too. Host state the step changes is frozen at its
captured value (a learning rate held as a Python float, Python counters): keep it in
tensors, as ``capturable=True`` optimizers do.

The warm-up runs (on a side stream, as PyTorch requires) and the check run are real
training steps: they update the parameters. The check run sees
``torch.cuda.is_current_stream_capturing()`` as True, as the capture will (code that
synchronises only outside a capture, as transformers' mask checks do, passes), and runs
compiled functions' Python eagerly (the same stages' compute a compiled graph calls
through its custom ops). The compiled graphs themselves are assumed to synchronise
nowhere (Inductor's code does not): one that did would fail at the capture, as a CUDA
error, not before it. Under ``fusible.autocast`` the capture pins
the recipe: a replay under another state raises.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fusible.core.lanes import splitting
from fusible.quantization.recipes.autocast import current_key

_aten = torch.ops.aten
# Ops that read a device value on the host (the step then waits for the device)
_HOST_SYNC = {_aten._local_scalar_dense.default, _aten.equal.default,
              _aten.is_nonzero.default}
# Ops whose result's shape depends on the values
_DATA_SHAPED = {_aten.nonzero.default, _aten.masked_select.default, _aten.unique_dim.default,
                _aten._unique2.default, _aten.unique_consecutive.default,
                _aten.repeat_interleave.Tensor}


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class UncapturableError(RuntimeError):
    """The step does something a CUDA graph cannot replay (see :func:`capture_step`)."""


class CaptureCheck(TorchDispatchMode):
    """Raise :class:`UncapturableError` at the first op a CUDA graph could not replay:
    a host synchronisation, a data-dependent shape, a CPU tensor beside CUDA ones; the
    message ends with the line of code that called it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _uncapturable(func, args, kwargs)
        if why is not None:
            raise UncapturableError(f"{func}: {why}{_caller()}")
        return func(*args, **kwargs)


def _uncapturable(func, args: tuple, kwargs: dict) -> Optional[str]:
    """Why a CUDA graph could not replay ``func(*args, **kwargs)``, or None."""
    if func in _HOST_SYNC:
        return ("reads a device value on the host (.item(), bool() or printing a tensor): "
                "a CUDA graph replays the device's work only; keep the value on the device, "
                "or read it after the replay")
    if func in _DATA_SHAPED or (func is _aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])):
        return "its result's shape depends on the values, which a CUDA graph fixes at capture"
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    on = {t.device.type for t in tensors if t.dim() or t.device.type != "cpu"}
    if "cpu" in on and len(on) > 1:
        return (f"mixes CPU and {sorted(on - {'cpu'})} tensors: host memory is read once at "
                f"capture (and copying to the CPU waits for the device)")
    if func is _aten._to_copy.default and kwargs.get("device") is not None and \
            torch.device(kwargs["device"]).type == "cpu" and "cpu" not in on:
        return "copies a device tensor to the CPU (a host synchronisation)"
    return None


def _caller() -> str:
    """``"; called at FILE:LINE (code)"``: the innermost frame outside torch and this
    module, where the step's code made the op."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename != __file__ and not frame.filename.startswith(_TORCH_DIR):
            return f"; called at {frame.filename}:{frame.lineno} ({frame.line})"
    return ""


@contextlib.contextmanager
def as_if_capturing() -> Iterator[None]:
    """In this thread, ``torch.cuda.is_current_stream_capturing()`` answers True: the
    check run takes the paths the step's code takes under capture (transformers skips its
    host-synchronising checks there). Other threads see the real answer."""
    with _PATCH_LOCK:
        if _PATCHED[0] == 0:
            _ORIGINAL[0] = torch.cuda.is_current_stream_capturing
            torch.cuda.is_current_stream_capturing = _capturing
        _PATCHED[0] += 1
    _PRETEND.depth = getattr(_PRETEND, "depth", 0) + 1
    try:
        yield
    finally:
        _PRETEND.depth -= 1
        with _PATCH_LOCK:
            _PATCHED[0] -= 1
            if _PATCHED[0] == 0:
                torch.cuda.is_current_stream_capturing = _ORIGINAL[0]


_PATCH_LOCK = threading.Lock()
_PATCHED = [0]  # how many as_if_capturing blocks are open, in every thread
_ORIGINAL: list = [None]
_PRETEND = threading.local()


def _capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing`` while an as_if_capturing block is open
    somewhere."""
    return getattr(_PRETEND, "depth", 0) > 0 or _ORIGINAL[0]()


def _eagerly():
    """The check run's compiled functions run their Python (``torch.compiler.set_stance
    ("force_eager")``): the check must see the ops of fusible's stages, which a compiled
    graph hides in its custom ops, and dynamo would otherwise recompile the step under the
    check's dispatch mode and pretended capture (frames it then runs piecewise). Nothing
    when dynamo was never loaded (nothing is compiled)."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def check_optimizers(optimizers: Sequence[torch.optim.Optimizer], name: str) -> None:
    """Raise :class:`UncapturableError` for an optimizer that keeps its step on the host."""
    for opt in optimizers:
        for group in opt.param_groups:
            if "capturable" in group and not group["capturable"]:
                raise UncapturableError(
                    f"{name}: {type(opt).__name__} counts its steps on the host: build it "
                    f"with capturable=True (and fused=True where it offers it)")


class CapturedStep:
    """A training step captured as one CUDA graph (:func:`capture_step`).

    Attributes
    ----------
    static_inputs : tuple of Tensor
        The buffers the graph reads; a call copies its arguments into them.
    static_output : Any
        What the step returned at capture, rewritten by each replay (clone it to keep it).
    graph : torch.cuda.CUDAGraph
    """

    def __init__(self, graph: "torch.cuda.CUDAGraph", static_inputs: tuple,
                 static_output: Any, recipe_key: Optional[str], name: str):
        self.graph, self.static_inputs = graph, static_inputs
        self.static_output, self.recipe_key, self.name = static_output, recipe_key, name

    def __call__(self, *inputs):
        """Copy ``inputs`` into the static buffers, replay, and return the static output."""
        if current_key() != self.recipe_key:
            raise RuntimeError(f"{self.name}: captured under FP8 recipe {self.recipe_key!r}, "
                               f"replayed under {current_key()!r}")
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"{self.name}: captured with {len(self.static_inputs)} inputs, "
                            f"called with {len(inputs)}")
        for i, (buffer, value) in enumerate(zip(self.static_inputs, inputs)):
            if value.shape != buffer.shape or value.dtype != buffer.dtype:
                raise ValueError(f"{self.name}: input {i} is {tuple(value.shape)} "
                                 f"{value.dtype}; the graph was captured for "
                                 f"{tuple(buffer.shape)} {buffer.dtype}")
            buffer.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.static_output


def capture_step(step: Callable, *example_inputs: torch.Tensor,
                 optimizers: Sequence[torch.optim.Optimizer] = (), warmup: int = 3,
                 pool: Any = None) -> CapturedStep:
    """Capture ``step(*inputs)`` (a whole training step) as one CUDA graph.

    Parameters
    ----------
    step : callable
        Runs one step on its tensor arguments (forward, loss, ``backward``, the optimizers'
        ``step`` and ``zero_grad``) and returns what a replay should give back (the loss,
        detached).
    *example_inputs : Tensor
        CUDA tensors of the shapes and dtypes of every later batch; copied into the
        static buffers.
    optimizers : sequence of Optimizer
        The step's optimizers, checked for ``capturable=True``.
    warmup : int
        Eager steps on a side stream before the capture (at least 1: Triton compiles,
        plans are made, optimizer states are created).
    pool
        A graph memory pool to share (``torch.cuda.graph_pool_handle()``).

    Returns
    -------
    CapturedStep
        Call it with each batch: ``loss = captured(ids, labels)``.

    Raises
    ------
    UncapturableError
        Naming the first op of the step a CUDA graph could not replay (checked on a real
        step after the warm-up), or an optimizer without ``capturable=True``.
    ValueError
        If an input is not a CUDA tensor.
    """
    name = f"fusible.capture_step({getattr(step, '__name__', type(step).__name__)})"
    check_optimizers(optimizers, name)
    if not example_inputs or not all(isinstance(t, torch.Tensor) and t.is_cuda
                                     for t in example_inputs):
        got = [t.device.type if isinstance(t, torch.Tensor) else type(t).__name__
               for t in example_inputs]
        raise ValueError(f"{name}: CUDA graphs need CUDA tensor inputs, got {got}")
    if warmup < 1:
        raise ValueError(f"{name}: warmup must be at least 1, got {warmup}")
    if splitting():
        raise UncapturableError(f"{name}: a split backward (fusible.split_backward) queues "
                                f"weight gradients in Python, which a replay skips")
    static_inputs = tuple(t.detach().clone() for t in example_inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    with CaptureCheck(), as_if_capturing(), _eagerly():  # after the warm-up, as the capture
        step(*static_inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        static_output = step(*static_inputs)
    return CapturedStep(graph, static_inputs, static_output, current_key(), name)
