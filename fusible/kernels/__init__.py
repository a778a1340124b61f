"""Kernels: Triton versions for CUDA, imported by the layers above, which keep the
plain-PyTorch arithmetic (the CPU path and the reference)."""

import importlib.util
import sys
import types
from typing import TYPE_CHECKING

import torch

# Triton is optional (CPU-only installs run the PyTorch ops) and imported when a kernel is
# first launched, not with fusible: its import costs 0.2 s that a CPU run never needs.
HAVE_TRITON = importlib.util.find_spec("triton") is not None
_TRITON_IMPORT_ERROR: "Exception | None" = None
_TRITON_IMPORTED = False
_LAZY_KERNELS: list = []


class _LazyTriton(types.ModuleType):
    """``triton`` or ``triton.language`` until Triton is imported: any attribute imports
    it. A module itself, so that Triton's compiler takes it as the kernels' ``tl``."""

    def __getattr__(self, attr):
        _import_triton()
        return getattr(sys.modules[self.__name__], attr)


class _LazyKernel:
    """A kernel decorated before Triton is imported: indexing it (a launch) or reading an
    attribute imports Triton, which compiles every such kernel and puts it in their place
    in the modules that hold them (device functions are found there by name)."""

    def __init__(self, fn):
        self.fn, self.kernel = fn, None
        _LAZY_KERNELS.append(self)

    def __getitem__(self, grid):
        return self._compiled()[grid]

    def __getattr__(self, attr):
        return getattr(self._compiled(), attr)

    def _compiled(self):
        _import_triton()
        return self.kernel


_STAND_IN_TYPES = (_LazyTriton, _LazyKernel)


def _import_triton() -> None:
    """Import Triton (once), compile the kernels decorated so far and put the real modules
    and kernels where the stand-ins were; RuntimeError when Triton is missing or fails to
    import."""
    global _TRITON_IMPORT_ERROR, _TRITON_IMPORTED
    if _TRITON_IMPORTED:
        return
    if not HAVE_TRITON or _TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(_why_no_triton())
    try:
        import triton
        import triton.language
    except Exception as error:  # noqa: BLE001 - a broken install: say why, once
        _TRITON_IMPORT_ERROR = error
        raise RuntimeError(_why_no_triton()) from error
    _TRITON_IMPORTED = True
    for lazy in _LAZY_KERNELS:
        lazy.kernel = _cached_launch_jit(lazy.fn)
    _replace_stand_ins()


def _why_no_triton() -> str:
    if not HAVE_TRITON:
        return "Triton is not installed"
    return f"Triton failed to import: {_TRITON_IMPORT_ERROR!r}"


def _replace_stand_ins() -> None:
    """The real ``triton``, ``triton.language`` and kernels in every module namespace that
    holds a stand-in (Triton's compiler finds a kernel's device functions there)."""
    stand_ins = {id(triton): sys.modules["triton"], id(tl): sys.modules["triton.language"]}
    stand_ins.update({id(lazy): lazy.kernel for lazy in _LAZY_KERNELS})
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or isinstance(module, _LazyTriton):
            continue
        for name, value in list(namespace.items()):
            # type(), not isinstance: the latter reads __class__, which deprecated module
            # attributes answer with a warning (torch.distributed.reduce_op)
            if type(value) in _STAND_IN_TYPES and id(value) in stand_ins:
                namespace[name] = stand_ins[id(value)]


if TYPE_CHECKING:  # the checker reads the kernels' annotations against Triton itself
    import triton
    import triton.language as tl
else:
    triton = _LazyTriton("triton") if HAVE_TRITON else None
    tl = _LazyTriton("triton.language") if HAVE_TRITON else None


def triton_imports() -> bool:
    """Whether Triton is installed and imports (importing it the first time)."""
    if _TRITON_IMPORTED or not HAVE_TRITON:
        return _TRITON_IMPORTED
    try:
        _import_triton()
    except RuntimeError:
        return False
    return True


def _never_compiled(fn):
    """Without Triton a kernel stays a plain function: defined, never launched (every
    launcher calls :func:`require_triton` first)."""
    return fn


def _arg_key(value):
    """What Triton's JIT specialises a runtime argument on, or finer: a tensor's dtype,
    device and 16-byte alignment; an int's width, whether it is 1 and whether 16 divides
    it; a bool's value; only the type of a float (always fp32) or None. Tensors come first:
    most arguments are pointers."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.get_device(), not value.data_ptr() & 15
    kind = type(value)
    if kind is int:  # i32, i64 or u64, as Triton types it
        width = 0 if -2**31 <= value < 2**31 else 1 if -2**63 <= value < 2**63 else 2
        return width, value == 1, not value & 15
    if kind is bool:
        return value, bool
    return kind


class CachedLaunches:
    """The launches of one Triton kernel: ``kernel[grid](...)`` through
    ``JITFunction.run`` binds and specialises every argument again on every call (15 us
    a launch on the H200's host, 8 through the compiled kernel; a host-bound FP8 step
    launches 15 Triton kernels), so a call with the specialisation of an earlier one
    launches that call's compiled kernel directly.

    The key (:func:`_arg_key` of each runtime argument, the values of the constexpr and
    option arguments) is at least as fine as Triton's own, so a hit is the kernel Triton
    would pick; a miss, a warm-up, a grid function, pre-run hooks or arguments left to
    their defaults go through ``JITFunction.run``, and its compiled kernel joins the
    cache.
    """

    def __init__(self, kernel, jit_run):
        self.kernel, self.jit_run = kernel, jit_run
        self.launches = {}
        self.names = list(kernel.arg_names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.constexpr = [p.is_constexpr for p in kernel.params]
        self.layouts = {}  # (number of positional arguments, keyword names) -> _layout

    def __call__(self, *args, grid, warmup, **kwargs):
        key = None if warmup or type(grid) is not tuple else self.key(args, kwargs)
        hit = None if key is None else self.launches.get(key)
        if hit is None:
            compiled = self.jit_run(*args, grid=grid, warmup=warmup, **kwargs)
            if key is not None and compiled is not None:
                self.launches[key] = compiled
            return compiled
        ordered = list(args) + [kwargs[name] for name in self.names[len(args):]]
        hit[(grid[0], grid[1] if len(grid) > 1 else 1,
             grid[2] if len(grid) > 2 else 1)](*ordered)
        return hit

    def key(self, args, kwargs):
        """The cache key of a call, or None where Triton's own path must run."""
        names = tuple(kwargs)
        layout = self.layouts.get((len(args), names))
        if layout is None:
            layout = self.layouts[(len(args), names)] = self._layout(len(args), names)
        if layout is False or getattr(self.kernel, "pre_run_hooks", None):
            return None
        positional, keyword = layout
        return (names,
                tuple([_arg_key(a) if runtime else a for a, runtime in zip(args, positional)]),
                tuple([_arg_key(v) if runtime else v
                       for v, runtime in zip(kwargs.values(), keyword)]))

    def _layout(self, n_args: int, names: tuple):
        """Which positional and keyword values are runtime arguments (keyed by
        :func:`_arg_key`; constexprs and launch options by value), or False when some
        argument is left to its default."""
        if n_args + sum(name in names for name in self.names[n_args:]) != len(self.names):
            return False
        runtime = [not c for c in self.constexpr]
        return (runtime[:n_args],
                [name in self.index and runtime[self.index[name]] for name in names])


def _cached_launch_jit(fn):
    """``triton.jit``; where Triton compiles (not under its interpreter) the kernel's
    ``run`` goes through :class:`CachedLaunches` (an attribute of this kernel alone:
    its type stays ``JITFunction``, as the compiler expects of the device functions
    decorated alike)."""
    real = sys.modules["triton"]
    kernel = real.jit(fn)
    if isinstance(kernel, real.runtime.jit.JITFunction):
        kernel.run = CachedLaunches(kernel, kernel.run)
    return kernel


def _lazy_jit(fn):
    """``triton.jit`` once Triton is imported (:func:`_cached_launch_jit`), a
    :class:`_LazyKernel` before."""
    if _TRITON_IMPORTED:
        return _cached_launch_jit(fn)
    return _LazyKernel(fn)


# The kernel modules import Triton from here, once, and decorate with this.
jit = _lazy_jit if HAVE_TRITON else _never_compiled
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a Parameter is a plain tensor to the kernels


def plain_eager(*tensors: torch.Tensor) -> bool:
    """Whether these are real tensors outside any tracing (dynamo, AOTAutograd, make_fx,
    fake or functional modes, functorch transforms): then the kernels can be called
    directly, saving the custom op's dispatch (tens of microseconds of host time per
    call, which a small, host-bound step pays many times). Same kernels, same bits.
    """
    if torch.compiler.is_compiling():  # first: dynamo folds it and skips the rest
        return False
    return (all(type(t) in _PLAIN for t in tensors)
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active())


def triton_can_run(*tensors) -> bool:
    """Whether the Triton kernels take these tensors: plain CUDA tensors (not the fake
    ones of a trace, which get the PyTorch ops for their shapes, nor other subclasses) in a
    dtype the kernels compute in, with Triton installed."""
    return (all(type(t) in _PLAIN and t.is_cuda and t.dtype in _TRITON_DTYPES for t in tensors)
            and triton_imports())


def require_triton(name: str) -> None:
    """Import Triton where it is not yet imported; RuntimeError naming ``name`` when it is
    not installed or failed to import."""
    try:
        _import_triton()
    except RuntimeError as error:
        raise RuntimeError(f"{name} needs Triton: {error}") from None
