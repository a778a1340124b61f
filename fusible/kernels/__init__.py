"""Kernels: Triton versions for CUDA, imported by the layers above, which keep the
plain-PyTorch arithmetic (the CPU path and the reference)."""

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # optional: CPU-only installs run the PyTorch ops
    triton = tl = None
    _TRITON_IMPORT_ERROR = error
HAVE_TRITON = triton is not None


def _never_compiled(fn):
    """Without Triton a kernel stays a plain function: defined, never launched (every
    launcher calls :func:`require_triton` first)."""
    return fn


# The kernel modules import Triton from here, once, and decorate with this.
jit = triton.jit if HAVE_TRITON else _never_compiled
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
    return HAVE_TRITON and all(type(t) in _PLAIN and t.is_cuda and t.dtype in _TRITON_DTYPES
                               for t in tensors)


def require_triton(name: str) -> None:
    """RuntimeError naming ``name`` when Triton failed to import."""
    if triton is None:
        raise RuntimeError(f"{name} needs Triton, which failed to import: "
                           f"{_TRITON_IMPORT_ERROR!r}")
