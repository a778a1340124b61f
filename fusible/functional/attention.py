"""Scaled dot-product attention forward and backward as separate calls (a stage computes
each direction on its own), on the ``(batch, seq, heads, head_dim)`` layout the QKV
preparation writes, through one of PyTorch's attention kernels chosen explicitly:

- ``"flash"``: on CUDA FlashAttention-2 (``aten._flash_attention_forward``) in its
  variable-length form, which takes that layout as it is and covers grouped-query
  attention, sliding windows and packed documents; on the CPU PyTorch's flash kernel
  (causal or bidirectional, grouped-query; no window, no documents).
- ``"cudnn"``: cuDNN's fused attention (CUDA; causal or bidirectional, grouped-query with
  the kv heads read as they are).
- ``"flex"``: ``torch.nn.attention.flex_attention``, compiled (Inductor writes its
  kernel; CUDA only: PyTorch's CPU flex has no backward), for what the others lack: logit
  soft-capping (Gemma 2's ``cap * tanh(scores / cap)``) with causal masks and sliding
  windows. Its backward runs the forward again under autograd (the flex kernels' backward
  comes with their forward only), a third more attention time than a kernel with a
  separate backward.
- ``"triton"``: fusible's own FlashAttention-style kernels
  (:mod:`fusible.kernels.attention`; CUDA, float16 or bfloat16, head_dim 16, 32 or 64,
  causal or bidirectional, grouped-query; no window, documents or soft-capping), chosen
  by default where they beat cuDNN's: heads up to :data:`TRITON_DEFAULT_HEAD_DIM` wide.
- ``"math"``: the formulas in PyTorch ops, float32 (float64 for float64 inputs), the
  whole ``S x S`` score matrix in memory: the reference, and what runs where no kernel
  fits. Never chosen on a GPU unless asked for.

Masks: ``causal`` (key ``t`` seen by query ``s`` when ``t <= s``), ``window`` (Hugging
Face's ``sliding_window``: ``|s - t| < window``) and documents (``cu_seqlens``: tokens see
only their own document; the batch is one packed row).
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Optional, Union

import attrs
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention import flex_attention as flex
from torch.utils._python_dispatch import _disable_current_modes

from fusible.kernels import triton_imports
from fusible.kernels import attention as attention_kernels
from fusible.quantization.tensor.float8_tensor import Float8Tensor

Tensor = torch.Tensor

BACKENDS = ("flash", "cudnn", "flex", "triton", "math")
# The widest heads the Triton kernels get by default (measured against cuDNN's on an H100:
# docs/benchmarks.md); they run up to TRITON_HEAD_DIMS[-1] when asked for.
TRITON_DEFAULT_HEAD_DIM = 32
TRITON_HEAD_DIMS = (16, 32, 64)
_HALF = (torch.float16, torch.bfloat16)
_FLEX_CONFIG_LOCK = threading.Lock()


@attrs.frozen
class AttentionOptions:
    """What an attention call computes, and with which kernel.

    Attributes
    ----------
    causal : bool
    scale : float
        The softmax scale (``1 / sqrt(head_dim)`` by default in the op).
    window : int
        Keys within this many positions of the query, itself included (0: no window).
    backend : str
        One of :data:`BACKENDS`, as :func:`choose_backend` resolved it.
    softcap : float
        Logit soft-capping: the scaled scores become ``softcap * tanh(scores / softcap)``
        before the mask and the softmax (Gemma 2's ``attn_logit_softcapping``); 0: none.
    """

    causal: bool
    scale: float
    window: int
    backend: str
    softcap: float = 0.0


# Shared memory per block the flex backward's kernels need above head_dim 128 (Inductor's
# configs: about 114-131 KiB; Hopper and A100 opt in to 227 and 163, consumer boards 99).
FLEX_WIDE_HEAD_KIB = 160


def _flex_shared_memory_refusal(head_dim: Optional[int]) -> Optional[str]:
    """Why this GPU's flex backward cannot take ``head_dim`` (over 128 on a GPU with less
    than FLEX_WIDE_HEAD_KIB of shared memory per block), or None."""
    if head_dim is None or head_dim <= 128 or not torch.cuda.is_available():
        return None
    kib = device_shared_memory_kib()
    if kib >= FLEX_WIDE_HEAD_KIB:
        return None
    return (f"head_dim {head_dim} over 128 needs {FLEX_WIDE_HEAD_KIB} KiB of shared memory "
            f"per block for the flex backward; this GPU has {kib}")


def device_shared_memory_kib() -> int:
    """The current CUDA device's opt-in shared memory per block, KiB (the plan knows the
    device type only; ROCm's properties have no opt-in figure: the default's)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block) // 1024


def _backend_refusal(backend: str, device_type: str, dtype: torch.dtype,
                     head_dim: Optional[int], window: int, documents: bool,
                     softcap: float = 0.0) -> Optional[str]:
    """Why ``backend`` cannot run this attention, or None (``head_dim`` None: not known yet,
    at planning; the run checks it)."""
    if backend == "math":
        return None
    if backend == "flex":
        if device_type != "cuda":  # (PyTorch's CPU flex_attention has no backward)
            return "the flex kernel runs on CUDA only"
        if head_dim is not None and head_dim < 16:  # (Inductor's flex lowering refuses it)
            return f"head_dim {head_dim} is under the flex kernel's 16"
        if documents:
            return "the flex kernel here takes no packed documents"
        return _flex_shared_memory_refusal(head_dim)
    if softcap:
        return f"the {backend} kernel has no logit soft-capping"
    if backend == "triton":
        return _triton_refusal(device_type, dtype, head_dim, window, documents)
    if device_type == "cpu":
        if backend != "flash":
            return f"the {backend} kernel runs on CUDA only"
        if window or documents:
            return "PyTorch's CPU flash kernel has no sliding window and no packed documents"
        return None
    if device_type != "cuda":
        return f"no {backend} kernel on {device_type}"
    if dtype not in _HALF:
        return f"the {backend} kernel takes float16 or bfloat16, not {dtype}"
    if backend == "cudnn" and (window or documents):
        return "the cuDNN kernel here has no sliding window and no packed documents"
    if backend == "cudnn" and head_dim is not None and head_dim > 128:
        return f"head_dim {head_dim} is over the cuDNN kernel's 128"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"head_dim {head_dim} is not a multiple of 8 up to 256"
    return None


def _triton_refusal(device_type: str, dtype: torch.dtype, head_dim: Optional[int],
                    window: int, documents: bool) -> Optional[str]:
    if device_type != "cuda":
        return "the triton kernel runs on CUDA only"
    if not triton_imports():  # (on CUDA only: a CPU run never imports it)
        return "Triton is not installed or failed to import"
    if dtype not in _HALF:
        return f"the triton kernel takes float16 or bfloat16, not {dtype}"
    if window or documents:
        return "the triton kernel has no sliding window and no packed documents"
    if head_dim is not None and head_dim not in TRITON_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of the triton kernel's {TRITON_HEAD_DIMS}"
    return None


def _default_refusal(backend: str, head_dim: Optional[int]) -> Optional[str]:
    """Why the default choice passes over a backend that could run this attention."""
    if backend == "triton" and (head_dim is None or head_dim > TRITON_DEFAULT_HEAD_DIM):
        return (f"taken by default for heads up to {TRITON_DEFAULT_HEAD_DIM} wide only "
                f"(cuDNN's kernels are faster above)")
    return None


def choose_backend(requested: Optional[str], device_type: str, dtype: torch.dtype,
                   head_dim: Optional[int], window: int, documents: bool,
                   where: Union[str, Callable[[], str]], softcap: float = 0.0) -> str:
    """The backend for this attention: ``requested`` if it can run it (else ValueError
    naming ``where`` and why), or on CUDA cuDNN's where it can (head_dim up to 128, no
    window or documents: on the H200 a 1B layer's attention takes 0.33 + 0.95 ms a step
    there against FlashAttention-2's 0.54 + 1.41), else flash, and for soft-capped logits
    (which neither takes) flex; on the CPU flash, else math. On a GPU the math kernel is
    never chosen unasked: ValueError saying why none fits. Heads up to
    :data:`TRITON_DEFAULT_HEAD_DIM` wide get the Triton kernels first. ``head_dim`` None (at
    planning, before the input's width is known) leaves its check to the run. ``where``
    may be a function that names it (called only for an error: a step asks each time)."""
    if requested is not None:
        why = _backend_refusal(requested, device_type, dtype, head_dim, window, documents,
                               softcap)
        if why:
            raise ValueError(f"{_name(where)}: backend={requested!r} cannot run this "
                             f"attention: {why}")
        return requested
    # (flex only for what the others cannot take: it compiles a kernel per shape where
    # they have one ready)
    order = ("flash", "math") if device_type == "cpu" else \
        ("cudnn", "flash", "flex") if softcap else ("triton", "cudnn", "flash")
    reasons = []
    for backend in order:
        why = _backend_refusal(backend, device_type, dtype, head_dim, window, documents,
                               softcap) or _default_refusal(backend, head_dim)
        if why is None:
            return backend
        reasons.append(f"{backend}: {why}")
    raise ValueError(f"{_name(where)}: no attention kernel on {device_type} fits "
                     f"({'; '.join(reasons)}); pass backend='math' to run the formulas with "
                     f"the whole score matrix")


def _name(where: Union[str, Callable[[], str]]) -> str:
    return where() if callable(where) else where


def mask(seq: int, options: AttentionOptions, cu_seqlens: Optional[Tensor],
         device) -> Tensor:
    """Which keys each query sees: bool ``(seq, seq)``."""
    s = torch.arange(seq, device=device)
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=device)
    if options.causal:
        allowed &= s[None, :] <= s[:, None]
    if options.window:
        allowed &= (s[:, None] - s[None, :]).abs() < options.window
    if cu_seqlens is not None:
        doc = document_index(cu_seqlens, seq)
        allowed &= doc[:, None] == doc[None, :]
    return allowed


def document_index(cu_seqlens: Tensor, tokens: int) -> Tensor:
    """Each token's document, from the documents' start offsets ``cu_seqlens``."""
    return torch.searchsorted(cu_seqlens[1:-1].long(),
                              torch.arange(tokens, device=cu_seqlens.device), right=True)


def _grouped(x: Tensor, groups: int, acc: torch.dtype) -> Tensor:
    """``(B, S, H, D)`` as ``(B, S, K, groups, D)`` in ``acc``: query head ``h`` reads kv
    head ``h // groups``, as Hugging Face's ``repeat_kv`` does."""
    b, s, h, d = x.shape
    return x.to(acc).view(b, s, h // groups, groups, d)


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _math_probabilities(q, k, options, cu_seqlens):
    """``(p, lse, qf, kf, capped)``: the softmax ``(B, K, g, S, S)``, its log-sum-exp, and
    with soft-capping the ``tanh`` of the capped scores (None without)."""
    groups = q.shape[2] // k.shape[2]
    qf, kf = _grouped(q, groups, _acc(q)), k.to(_acc(q))
    scores = torch.einsum("bskgd,btkd->bkgst", qf, kf) * options.scale
    capped = None
    if options.softcap:
        capped = torch.tanh(scores / options.softcap)
        scores = capped * options.softcap
    allowed = mask(q.shape[1], options, cu_seqlens, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse[..., None]), lse, qf, kf, capped


def _math_forward(q, k, v, options, cu_seqlens):
    p, lse, *_ = _math_probabilities(q, k, options, cu_seqlens)
    out = torch.einsum("bkgst,btkd->bskgd", p, v.to(p.dtype))
    return out.reshape(q.shape).to(q.dtype).contiguous(), lse.flatten(1, 2)


def _math_backward(dout, q, k, v, out, options, cu_seqlens):
    p, _, qf, kf, capped = _math_probabilities(q, k, options, cu_seqlens)
    groups = q.shape[2] // k.shape[2]
    do, of = _grouped(dout, groups, p.dtype), _grouped(out, groups, p.dtype)
    dv = torch.einsum("bkgst,bskgd->btkd", p, do)
    dp = torch.einsum("bskgd,btkd->bkgst", do, v.to(p.dtype))
    delta = (do * of).sum(-1).permute(0, 2, 3, 1)  # (B, K, g, S)
    ds = p * (dp - delta[..., None]) * options.scale
    if capped is not None:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2
        ds = ds * (1 - capped * capped)
    dq = torch.einsum("bkgst,btkd->bskgd", ds, kf).reshape(q.shape)
    dk = torch.einsum("bkgst,bskgd->btkd", ds, qf)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _heads_first(*xs: Tensor) -> tuple:
    """``(B, S, H, D)`` as the ``(B, H, S, D)`` views SDPA's kernels take."""
    return tuple(x.transpose(1, 2) for x in xs)


def _varlen(q: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, int]:
    """FlashAttention's variable-length form: the documents' offsets, or one per batch
    row; and the longest (the whole row for documents: no host sync to measure it)."""
    b, s = q.shape[:2]
    if cu_seqlens is not None:
        return cu_seqlens.to(torch.int32), s
    return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device), s


def _flash_window(options: AttentionOptions) -> tuple[int, int]:
    if not options.window:
        return -1, -1
    return options.window - 1, 0 if options.causal else options.window - 1


# Training kernels only: Inductor takes its flex-decoding template for queries shorter
# than 128, which offers no kernel for these shapes (torch 2.11: "no choices").
_FLEX_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


def _flex_with_lse(q, k, v, score_mod, block_mask, scale, enable_gqa):
    out, aux = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                   scale=scale, enable_gqa=enable_gqa,
                                   kernel_options=_FLEX_OPTIONS,
                                   return_aux=flex.AuxRequest(lse=True))
    return out, aux.lse


def _flex_for_grad(q, k, v, score_mod, block_mask, scale, enable_gqa):
    return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                               scale=scale, enable_gqa=enable_gqa,
                               kernel_options=_FLEX_OPTIONS)


@functools.lru_cache(maxsize=None)
def _flex_kernel(device_type: str, with_lse: bool):
    """flex attention compiled once per process and direction on CUDA (eager, it runs the
    formulas; the forward and the backward's autograd run are two functions: dynamo keeps
    its compiled variants per function; sequence lengths turn dynamic after the first
    change); eager on the CPU (forward only: the tests' way to its masks and score
    changes)."""
    function = _flex_with_lse if with_lse else _flex_for_grad
    return function if device_type == "cpu" else torch.compile(function)


@functools.lru_cache(maxsize=None)
def _softcap_mod(cap: float):
    """A flex ``score_mod`` capping the scores at ``cap`` (one function per value: the
    compiled kernel is kept for it)."""
    def softcap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    return softcap


@functools.lru_cache(maxsize=32)
def _block_mask(seq: int, causal: bool, window: int, device: str):
    """The flex block mask of a causal and/or windowed pattern over ``seq`` tokens (None:
    every key seen), kept per pattern (building one reads every block)."""
    if not causal and not window:
        return None

    def allowed(b, h, q_idx, kv_idx):
        seen = q_idx >= kv_idx if causal else q_idx == q_idx
        if window:
            seen = seen & ((q_idx - kv_idx).abs() < window)
        return seen
    return flex.create_block_mask(allowed, None, None, seq, seq, device=device)


_KEYS = torch._C.DispatchKey
# The keys vmap (flex's block masks and score changes) dispatches through: excluded where
# a dispatch mode runs the op from its __torch_dispatch__ (AOTAutograd's first call of a
# compiled graph checks custom ops' aliasing so)
_FUNCTORCH_KEYS = functools.reduce(lambda a, b: a | b, (torch._C.DispatchKeySet(key) for key in (
    _KEYS.FuncTorchDynamicLayerBackMode, _KEYS.FuncTorchDynamicLayerFrontMode,
    _KEYS.FuncTorchBatched, _KEYS.FuncTorchVmapMode, _KEYS.FuncTorchGradWrapper,
    _KEYS.PythonTLSSnapshot)))


def _functorch_keys_allowed():
    """The dispatch keys' state with :data:`_FUNCTORCH_KEYS` allowed (as in any plain
    eager call of the op)."""
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set()
                                           - _FUNCTORCH_KEYS)


def _flex(q, k, v, options: AttentionOptions, with_lse: bool):
    """flex attention on the heads-first views: ``(out, lse)`` or ``out``."""
    qh, kh, vh = _heads_first(q, k, v)
    mod = _softcap_mod(float(options.softcap)) if options.softcap else None
    # the caller's dispatch modes set aside (AOTAutograd's first-call aliasing check would
    # send the block mask's vmap and the kernel's ops through its mode), and an error, not
    # dynamo's silent eager fallback (the whole score matrix), past the recompile limit
    # (a process-wide setting: one thread at a time sets and restores it)
    with _FLEX_CONFIG_LOCK, _disable_current_modes(), _functorch_keys_allowed(), \
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        block_mask = _block_mask(q.shape[1], options.causal, options.window, str(q.device))
        return _flex_kernel(q.device.type, with_lse)(qh, kh, vh, mod, block_mask,
                                                     options.scale, q.shape[2] != k.shape[2])


def _flex_forward(q, k, v, options):
    if is_fake(q):  # a trace's: the shapes only
        b, s, h, _ = q.shape
        return torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32)
    out, lse = _flex(q, k, v, options, True)
    return out.transpose(1, 2).contiguous(), lse


def _flex_backward(dout, q, k, v, options):
    """The gradients by running the forward again under autograd (see the module notes)."""
    if is_fake(q):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out = _flex(*inputs, options, False).transpose(1, 2)
        return torch.autograd.grad(out, inputs, dout)


def _values(t: Tensor) -> Tensor:
    """A plain tensor of ``t``'s values for a Triton kernel: an FP8 plan hands the
    attention's output to the next GEMM as a Float8Tensor, and saves that (its data is
    not the values: the kernels read memory, not dispatch)."""
    return t._dequantize_raw() if isinstance(t, Float8Tensor) else t


def _triton_forward(q, k, v, options):
    if is_fake(q):  # a trace's: the shapes only
        b, s, h, _ = q.shape
        return torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32)
    return attention_kernels.attention_forward_triton(q, k, v, options.causal, options.scale)


def attention_forward(q: Tensor, k: Tensor, v: Tensor, options: AttentionOptions,
                      cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, lse, rng_state)``: ``out`` ``(B, S, H, D)``; ``lse`` and ``rng_state`` as the
    backend makes them (for :func:`attention_backward`). ``q`` ``(B, S, H, D)``, ``k`` and
    ``v`` ``(B, S, K, D)`` with ``H`` a multiple of ``K``."""
    backend = options.backend
    empty = q.new_empty(0, dtype=torch.int64)
    if backend == "math":
        out, lse = _math_forward(q, k, v, options, cu_seqlens)
        return out, lse, empty
    if backend == "flex":
        out, lse = _flex_forward(q, k, v, options)
        return out, lse, empty
    if backend == "triton":
        out, lse = _triton_forward(q, k, v, options)
        return out, lse, empty
    if backend == "flash" and q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_heads_first(q, k, v), 0.0, options.causal, scale=options.scale)
        return out.transpose(1, 2).contiguous(), lse, empty
    if backend == "flash" and q.device.type == "cuda":
        b, s, h, d = q.shape
        cu, longest = _varlen(q, cu_seqlens)
        left, right = _flash_window(options)
        out, lse = torch.ops.aten._flash_attention_forward(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, longest, longest, 0.0,
            options.causal, False, scale=options.scale, window_size_left=left,
            window_size_right=right)[:2]
        # no dropout: a zero random state, as torch.nn.attention.varlen passes it
        return out.view(b, s, h, d), lse, torch.zeros(2, dtype=torch.uint64, device=q.device)
    if backend == "cudnn" and q.device.type == "cuda":
        # grouped kv heads as they are: cuDNN reads each for its query heads (PyTorch 2.8+)
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            *_heads_first(q, k, v), None, True, 0.0, options.causal, False,
            scale=options.scale)[:2]
        # (B, S, H, D): a no-op where cuDNN wrote the heads' layout, as it does for these
        return out.transpose(1, 2).contiguous(), lse, empty  # no dropout: no random state
    raise ValueError(f"no {backend!r} attention kernel on {q.device.type}")


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, rng_state: Tensor, options: AttentionOptions,
                       cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the layouts of ``q``, ``k``, ``v`` (grouped-query: ``dk`` and
    ``dv`` summed over each kv head's query heads)."""
    backend = options.backend
    if backend == "math":
        return _math_backward(dout, q, k, v, out, options, cu_seqlens)
    if backend == "flex":
        return _flex_backward(dout, q, k, v, options)
    if backend == "triton":
        if is_fake(q):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        return attention_kernels.attention_backward_triton(
            _values(dout), q, k, v, _values(out), lse, options.causal, options.scale)
    if backend == "flash" and q.device.type == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *_heads_first(dout, q, k, v, out), lse, 0.0, options.causal, scale=options.scale)
        return tuple(g.transpose(1, 2).contiguous() for g in grads)
    if backend == "flash" and q.device.type == "cuda":
        cu, longest = _varlen(q, cu_seqlens)
        left, right = _flash_window(options)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
            out.flatten(0, 1), lse, cu, cu, longest, longest, 0.0, options.causal, rng_state,
            q.new_empty(0), scale=options.scale, window_size_left=left,
            window_size_right=right)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
    if backend == "cudnn" and q.device.type == "cuda":
        s = q.shape[1]
        zero = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unread
        # None: the undefined tensors of an attention without bias and without documents
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            *_heads_first(dout, q, k, v, out), lse, zero, zero, None, None, None, s, s, 0.0,
            options.causal, scale=options.scale)
        # dk and dv come per kv head, summed over its query heads by the kernel
        dq, dk, dv = (g.transpose(1, 2).contiguous() for g in (dq, dk, dv))
        return dq, dk, dv
    raise ValueError(f"no {backend!r} attention kernel on {q.device.type}")
