"""Attention: self-attention over a fused QKV projection's output, with the rotary
embedding, grouped-query heads, per-head q/k norms, sliding windows and packed documents.
The arithmetic: :mod:`fusible.functional.qkv` (the inputs' preparation, one Triton kernel
each way on CUDA) and :mod:`fusible.functional.attention` (the kernels)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from fusible.core import checks
from fusible.core.arg_types import DTypeArg, DeviceArg, GroupArg
from fusible.core.example import Example
from fusible.core.results import BackwardResult, ForwardResult
from fusible.functional import attention as attn
from fusible.functional import parallel
from fusible.functional import qkv as qkv_prep
from fusible.functional.norms import effective_gamma
from fusible.functional.rotary import (RotaryOptions, angles_of, apply_rotary,
                                       is_sequence_positions, rotary_angles, sequence_angles)
from fusible.module import BasicOperation

Tensor = torch.Tensor

_INTEGER = (torch.int32, torch.int64)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


@attrs.define
class AttentionForwardArgs:
    input: Tensor
    cu_seqlens: Optional[Tensor]
    position_ids: Optional[Tensor]
    cos: Optional[Tensor]  # the rotary tables, when given
    sin: Optional[Tensor]
    q_norm_weight: Optional[Tensor]
    k_norm_weight: Optional[Tensor]
    layout: qkv_prep.HeadLayout
    rotary: RotaryOptions  # rotary_dim 0: no rotary embedding
    options: attn.AttentionOptions
    eps: float
    qk_zero_centered: bool = False  # the q/k norms scale by 1 + weight


@attrs.define
class AttentionSaved:
    """What the backward reads.

    Attributes
    ----------
    input : Tensor or None
        The QKV input, where q, k, v are views of it (no rotary, no norms) or the norms
        need their inputs.
    prepared : Tensor
        q, k, v side by side (flat), as the kernel saw them; empty when they are views of
        ``input``.
    output : Tensor
        The attention's output ``(B, S, H * D)``.
    lse, rng_state : Tensor
        The kernel's softmax statistics and random state, for its backward.
    q_rstd, k_rstd : Tensor
        The norms' statistics (empty without norms).
    cu_seqlens, position_ids, cos, sin, q_norm_weight, k_norm_weight : Tensor or None
    """

    input: Optional[Tensor]
    prepared: Tensor
    output: Tensor
    lse: Tensor
    rng_state: Tensor
    q_rstd: Tensor
    k_rstd: Tensor
    cu_seqlens: Optional[Tensor]
    position_ids: Optional[Tensor]
    cos: Optional[Tensor]
    sin: Optional[Tensor]
    q_norm_weight: Optional[Tensor]
    k_norm_weight: Optional[Tensor]


@attrs.define
class AttentionBackwardArgs:
    grad_output: Tensor
    input: Optional[Tensor]
    prepared: Tensor
    output: Tensor
    lse: Tensor
    rng_state: Tensor
    q_rstd: Tensor
    k_rstd: Tensor
    cu_seqlens: Optional[Tensor]
    position_ids: Optional[Tensor]
    cos: Optional[Tensor]
    sin: Optional[Tensor]
    q_norm_weight: Optional[Tensor]
    k_norm_weight: Optional[Tensor]
    layout: qkv_prep.HeadLayout
    rotary: RotaryOptions
    options: attn.AttentionOptions
    need_grad_norms: bool
    qk_zero_centered: bool = False


def _rotary(options: RotaryOptions) -> Optional[RotaryOptions]:
    return options if options.rotary_dim else None


def _angles(x: Tensor, rotary, cu_seqlens, position_ids, cos, sin) -> Optional[tuple]:
    """The rotary tables ``(cos, sin)``: given (in float32, float64 for a float64 ``x``),
    or made from the positions (None without a rotary embedding)."""
    if rotary is None:
        return None
    if cos is not None:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        return cos.to(acc).contiguous(), sin.to(acc).contiguous()  # the kernel's rows
    plain = type(x) is torch.Tensor  # not a fake tensor of a trace
    if cu_seqlens is None and (position_ids is None or is_sequence_positions(position_ids)):
        return sequence_angles(x.shape[1], x.device, rotary, keep=plain)  # 0..S-1
    batch, seq = x.shape[0], x.shape[1]

    def make():
        return rotary_angles(qkv_prep.positions(batch, seq, cu_seqlens, position_ids,
                                                x.device), rotary)
    if cu_seqlens is None and plain and type(position_ids) is torch.Tensor:
        return angles_of(position_ids, batch, seq, rotary, make)  # every layer's: one table
    return make()


class Attention(BasicOperation):
    """Self-attention over a fused QKV projection's output.

    The input ``(B, S, (num_heads + 2 * num_kv_heads) * head_dim)`` holds the query heads,
    then the key heads, then the value heads along its last dimension (Hugging Face's
    separate q/k/v projections stacked); the output is ``(B, S, num_heads * head_dim)``,
    heads side by side. Query head ``h`` attends with key/value head
    ``h // (num_heads // num_kv_heads)`` (grouped-query attention, as ``repeat_kv``).

    Per head, optionally: RMSNorm of q and k over ``head_dim`` (Qwen3), then the rotary
    embedding (:mod:`fusible.functional.rotary`), then
    ``softmax(q k^T * softmax_scale + mask) v``. On CUDA the preparation is one Triton
    kernel each way and the attention is FlashAttention-2; the kernel is chosen when the
    op is planned and shown in ``plan().explain()`` (see ``backend``).

    Parameters
    ----------
    num_heads : int
    num_kv_heads : int, optional
        Key/value heads (a divisor of ``num_heads``); ``num_heads`` when None.
    causal : bool
        Each token attends to itself and the tokens before it; False: to all (encoders).
    rotary_base : float, optional
        Apply the rotary embedding with this base (``rope_theta``); None: none.
    rotary_interleaved : bool
        Rotate interleaved pairs ``(x[2i], x[2i+1])`` (GPT-J, Meta's Llama code) rather
        than Hugging Face's ``rotate_half`` halves.
    softmax_scale : float, optional
        ``1 / sqrt(head_dim)`` when None.
    rotary_fraction : float
        The fraction of ``head_dim`` that rotates (GPT-NeoX's ``rotary_pct``, Phi's
        ``partial_rotary_factor``); the rotated width must be even.
    rotary_scaling : dict, optional
        Llama 3.1's frequency rescaling, as Hugging Face's ``rope_scaling`` with
        ``rope_type="llama3"``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings``.
    head_dim : int, optional
        Checked against the input; needed with ``qk_norm`` (the weights' size).
    qk_norm : bool
        RMSNorm over each q and k head before the rotary embedding, weights
        ``q_norm_weight`` and ``k_norm_weight`` ``(head_dim,)``.
    qk_norm_eps : float
    qk_norm_zero_centered : bool
        The q/k norms scale by ``1 + weight`` (computed in float32; Gemma 3's), their
        weights starting at zero.
    window : int, optional
        Sliding window (Hugging Face's ``sliding_window``): a query sees the keys less than
        ``window`` positions away, itself included.
    softcap : float, optional
        Logit soft-capping (Gemma 2's ``attn_logit_softcapping``): the scaled scores
        become ``softcap * tanh(scores / softcap)`` before the mask and the softmax. On
        CUDA only the ``"flex"`` kernel takes it, chosen for it (the math formulas on the
        CPU).
    documents : bool
        Packed sequences: called ``model(x, cu_seqlens)`` with ``x`` ``(1, T, ...)`` and
        ``cu_seqlens`` (int32, ``(documents + 1,)``) the documents' start offsets and ``T``;
        tokens attend only within their document, and rotary positions restart at each.
    position_ids : bool
        Rotary positions given: called ``model(x, [cu_seqlens,] position_ids)`` with
        integer ``position_ids`` ``(B, S)`` or ``(S,)``.
    rotary_tables : bool
        The rotary angles given rather than made from ``rotary_base`` (a model's own
        tables: any frequency scheme, as Hugging Face's ``position_embeddings`` or
        torchtitan's ``freqs_cis``): called ``model(x, [cu_seqlens,] cos, sin)`` with
        floating ``cos`` and ``sin`` ``(S, R / 2)``, ``(1, S, R / 2)`` or ``(B, S, R / 2)``
        for the rotated width ``R = head_dim * rotary_fraction`` (one angle per pair);
        ``rotary_base``, ``rotary_scaling`` and ``position_ids`` are then not taken.
    tensor_parallel : bool
        Split the heads over ``tensor_parallel_group`` (Megatron's attention): rank ``r``
        computes q heads ``r * num_heads / ws ...`` and k/v heads ``r * num_kv_heads / ws
        ...`` (both must divide by the world size ``ws``) from a column-parallel QKV
        projection whose rows are laid out rank by rank (each rank's shard ``[its q | its
        k | its v]``: :func:`fusible.layers.qkv_rows_by_rank`), and hands its heads'
        outputs to a row-parallel output projection. Needs ``head_dim``; the q/k norm
        weights' gradients are summed over the group.
    tensor_parallel_group : ProcessGroup or 1-D DeviceMesh, optional
        The default group when None.
    backend : {"flash", "cudnn", "flex", "triton", "math"}, optional
        The attention kernel; None: on CUDA fusible's Triton kernels for heads up to
        ``fusible.functional.attention.TRITON_DEFAULT_HEAD_DIM`` (32) wide, else cuDNN's
        where it runs (see below), else flash
        (float16/bfloat16, ``head_dim`` a multiple of 8 up to 256); on the CPU PyTorch's
        flash kernel (without windows or documents), else the math formulas. A GPU never runs the
        math formulas (the whole score matrix) unasked: ValueError instead. ``"cudnn"``:
        cuDNN's fused attention (CUDA, float16/bfloat16, ``head_dim`` up to 128, no window
        or documents; grouped kv heads read as they are), the kernel PyTorch's SDPA picks on
        Hopper, and the default on CUDA where it fits (faster than FlashAttention-2 on the
        H200: a Llama-3.2-1B layer 6.20 against 6.65 ms a step). ``"flex"``: PyTorch's
        ``flex_attention``, compiled (CUDA only; causal, windows, soft-capping; no
        packed documents; ``head_dim`` 16 up, over 128 on GPUs with 160 KiB of shared
        memory per block), chosen unasked only for soft-capped logits,
        which the others do not take; its backward runs the forward again. ``"triton"``:
        FlashAttention's algorithm in fusible's own Triton kernels (CUDA, float16/bfloat16,
        ``head_dim`` 16, 32 or 64, causal or bidirectional, grouped kv heads; no window,
        documents or soft-capping), faster than cuDNN's at narrow heads.
    device, dtype
        Of the q/k norm weights.
    """

    param_names: tuple = ()  # ("q_norm_weight", "k_norm_weight") with qk_norm
    rounds_within = ("the attention kernels take q, k and v in the input dtype (normed and "
                     "rotated, rounded once) and round the softmax probabilities to it for "
                     "the second GEMM, as FlashAttention does")
    input_dims = 3  # (batch, seq, features)
    attribute_checks = {
        "num_heads": checks.positive_int("num_heads"),
        "num_kv_heads": checks.positive_int("num_kv_heads"),
        "causal": checks.boolean("causal"),
        "rotary_base": checks.optional(checks.positive_real("rotary_base")),
        "rotary_interleaved": checks.boolean("rotary_interleaved"),
        "rotary_fraction": checks.positive_real("rotary_fraction"),
        "softmax_scale": checks.optional(checks.positive_real("softmax_scale")),
        "head_dim": checks.optional(checks.positive_int("head_dim")),
        "qk_norm": checks.boolean("qk_norm"),
        "qk_norm_eps": checks.positive_real("qk_norm_eps"),
        "qk_norm_zero_centered": checks.boolean("qk_norm_zero_centered"),
        "window": checks.optional(checks.positive_int("window")),
        "softcap": checks.optional(checks.positive_real("softcap")),
        "documents": checks.boolean("documents"),
        "position_ids": checks.boolean("position_ids"),
        "rotary_tables": checks.boolean("rotary_tables"),
        "backend": checks.optional(checks.one_of("backend", attn.BACKENDS)),
        "tensor_parallel": checks.boolean("tensor_parallel"),
    }
    fwd_args_type = AttentionForwardArgs
    bwd_args_type = AttentionBackwardArgs
    saved_type = AttentionSaved

    def __init__(self, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 causal: bool = True, rotary_base: Optional[float] = None,
                 rotary_interleaved: bool = False, softmax_scale: Optional[float] = None,
                 rotary_fraction: float = 1.0, rotary_scaling: Optional[dict] = None,
                 head_dim: Optional[int] = None, qk_norm: bool = False,
                 qk_norm_eps: float = 1e-6, qk_norm_zero_centered: bool = False,
                 window: Optional[int] = None, softcap: Optional[float] = None,
                 documents: bool = False, position_ids: bool = False,
                 rotary_tables: bool = False, backend: Optional[str] = None, tensor_parallel: bool = False,
                 tensor_parallel_group: GroupArg = None, device: DeviceArg = None,
                 dtype: DTypeArg = None):
        super().__init__()
        self.tensor_parallel = tensor_parallel
        self.parallel = parallel.tensor_parallel(
            "Attention", "column" if tensor_parallel else None, False, tensor_parallel_group)
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.causal, self.rotary_base = causal, rotary_base
        self.rotary_interleaved, self.rotary_fraction = rotary_interleaved, rotary_fraction
        self.softmax_scale, self.head_dim = softmax_scale, head_dim
        self.qk_norm, self.qk_norm_eps, self.window = qk_norm, qk_norm_eps, window
        self.qk_norm_zero_centered, self.softcap = qk_norm_zero_centered, softcap
        self.documents, self.position_ids, self.backend = documents, position_ids, backend
        self.rotary_tables = rotary_tables
        self.rotary_scaling = self._check_scaling(rotary_scaling)
        self._check_heads()
        self.num_extra_inputs = int(documents) + int(position_ids) + 2 * int(rotary_tables)
        if qk_norm:
            if head_dim is None:
                raise ValueError(f"{self.describe()}: qk_norm=True needs head_dim (the size "
                                 f"of the norms' weights)")
            init = torch.zeros if qk_norm_zero_centered else torch.ones
            self.q_norm_weight = nn.Parameter(init(head_dim, device=device, dtype=dtype))
            self.k_norm_weight = nn.Parameter(init(head_dim, device=device, dtype=dtype))
            self.param_names = ("q_norm_weight", "k_norm_weight")

    def _check_heads(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.describe()}: num_heads must be a multiple of "
                             f"num_kv_heads, got {self.num_heads} and {self.num_kv_heads}")
        ws = self.parallel.world_size
        if self.num_heads % ws or self.num_kv_heads % ws:
            raise ValueError(f"{self.describe()}: the heads split over {ws} ranks: num_heads "
                             f"and num_kv_heads must divide by {ws}, got {self.num_heads} "
                             f"and {self.num_kv_heads}")
        if self.tensor_parallel and self.head_dim is None:
            raise ValueError(f"{self.describe()}: tensor_parallel=True needs head_dim (a "
                             f"rank's input holds its heads only; head_dim tells a whole, "
                             f"unsplit input apart)")
        if self.rotary_fraction > 1:
            raise ValueError(f"{self.describe()}: rotary_fraction must be at most 1, got "
                             f"{self.rotary_fraction}")
        if self.rotary_scaling is not None and self.rotary_base is None:
            raise ValueError(f"{self.describe()}: rotary_scaling given without rotary_base")
        if self.rotary_tables and (self.rotary_base is not None or self.position_ids):
            raise ValueError(f"{self.describe()}: rotary_tables=True takes the angles as "
                             f"inputs: rotary_base must be None and position_ids False, got "
                             f"{self.rotary_base} and {self.position_ids}")

    def _check_scaling(self, scaling: Optional[dict]) -> Optional[dict]:
        if scaling is None:
            return None
        kind = scaling.get("rope_type", scaling.get("type", "llama3"))
        missing = [key for key in _LLAMA3_KEYS if key not in scaling]
        if kind != "llama3" or missing:
            raise ValueError(f"{self.describe()}: rotary_scaling supports Llama 3.1's "
                             f"(rope_type 'llama3' with {', '.join(_LLAMA3_KEYS)}), got "
                             f"{scaling!r}")
        return {key: scaling[key] for key in _LLAMA3_KEYS}

    def describe(self) -> str:
        text = f"Attention(num_heads={self.num_heads}"
        if getattr(self, "num_kv_heads", self.num_heads) != self.num_heads:
            text += f", num_kv_heads={self.num_kv_heads}"
        text += f", causal={getattr(self, 'causal', True)}"
        for name in ("rotary_base", "window", "softcap", "head_dim"):
            if getattr(self, name, None) is not None:
                text += f", {name}={getattr(self, name)}"
        for name in ("rotary_interleaved", "qk_norm", "qk_norm_zero_centered", "documents",
                     "position_ids", "rotary_tables", "tensor_parallel"):
            if getattr(self, name, False):
                text += f", {name}=True"
        if getattr(self, "rotary_fraction", 1.0) != 1.0:
            text += f", rotary_fraction={self.rotary_fraction}"
        backend = getattr(self, "backend", None)
        return text + (f", backend={backend!r})" if backend else ")")

    def plan_note(self, conditions) -> str:
        """The attention kernel these conditions get, for ``explain()`` and the diagram;
        where the input's width is not known yet and narrow heads would get another
        kernel (the default's Triton kernels on CUDA), both."""
        try:
            chosen = self.kernel(conditions.device_type, conditions.dtype, self.head_dim)
            narrow = attn.TRITON_DEFAULT_HEAD_DIM
            if self.head_dim is None:
                for_narrow = self.kernel(conditions.device_type, conditions.dtype, narrow)
                if for_narrow != chosen:
                    return f"kernel: {for_narrow} for heads up to {narrow} wide, else {chosen}"
            return f"kernel: {chosen}"
        except ValueError as error:
            return f"no kernel fits: {error}"

    def kernel(self, device_type: str, dtype: torch.dtype, head_dim: Optional[int],
               where: Optional[str] = None) -> str:
        """The attention kernel this op runs on inputs of ``device_type`` and ``dtype``
        (``head_dim`` None: not known yet), as :func:`fusible.functional.attention.
        choose_backend` picks it for its options; ValueError naming ``where`` (this op by
        default) and why none fits."""
        return attn.choose_backend(self.backend, device_type, dtype, head_dim,
                                   self.window or 0, self.documents, where or self.describe,
                                   float(self.softcap or 0.0))

    # --- shapes and configuration

    def _layout(self, width: int) -> qkv_prep.HeadLayout:
        """This rank's heads (all of them without tensor parallelism) for an input of
        ``width`` features."""
        ws = self.parallel.world_size
        heads, kv_heads = self._local_heads()
        slots = heads + 2 * kv_heads
        if width % slots or (self.head_dim is not None and width != slots * self.head_dim):
            want = (f"{slots} x head_dim" if self.head_dim is None
                    else f"{slots} x {self.head_dim} = {slots * self.head_dim}")
            of_rank = f" of this rank's heads (split over {ws})" if ws > 1 else ""
            raise ValueError(f"{self.describe()}: the input's last dimension must be (num_heads "
                             f"+ 2 * num_kv_heads) x head_dim{of_rank} = {want}, got {width}")
        return qkv_prep.HeadLayout(heads, kv_heads, width // slots)

    def _local_heads(self) -> tuple:
        """``(q heads, k/v heads)`` this rank computes."""
        ws = self.parallel.world_size
        return self.num_heads // ws, self.num_kv_heads // ws

    def check_split_features(self, producer, world_size):
        if self.parallel.world_size != world_size:
            raise ValueError(
                f"{self.describe()} after the column-parallel {producer}: each of the "
                f"{world_size} ranks holds a slice of the QKV features. Split the heads too: "
                f"construct the attention with tensor_parallel=True over the same group, and "
                f"lay the projection's rows out rank by rank (fusible.layers.qkv_rows_by_rank "
                f"on its weight and bias)")

    def grad_reduction(self):
        # the q/k norm weights are shared by every head: each rank's gradient covers its own
        return self.parallel if self.qk_norm and self.parallel.active else None

    def _rotary_options(self, head_dim: int) -> RotaryOptions:
        if self.rotary_base is None and not self.rotary_tables:
            return RotaryOptions(1.0, 0)
        rotary_dim = int(round(head_dim * self.rotary_fraction))
        if rotary_dim % 2 or not rotary_dim:
            raise ValueError(f"{self.describe()}: the rotated width head_dim x rotary_fraction "
                             f"= {head_dim} x {self.rotary_fraction} must be a positive even "
                             f"number, got {rotary_dim}")
        scaling = self.rotary_scaling or {}
        return RotaryOptions(
            float(self.rotary_base or 1.0), rotary_dim, self.rotary_interleaved,
            float(scaling.get("factor", 1.0)), float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)))

    def _options(self, x_device_type: str, dtype, head_dim: int) -> attn.AttentionOptions:
        backend = self.kernel(x_device_type, dtype, head_dim)
        scale = self.softmax_scale if self.softmax_scale is not None else head_dim ** -0.5
        return attn.AttentionOptions(self.causal, float(scale), self.window or 0, backend,
                                     float(self.softcap or 0.0))

    def _extras(self, extra_inputs) -> tuple:
        """``(cu_seqlens, position_ids, cos, sin)`` (None where not taken)."""
        extras = list(extra_inputs)
        cu = extras.pop(0) if self.documents else None
        pos = extras.pop(0) if self.position_ids else None
        cos, sin = (extras[0], extras[1]) if self.rotary_tables else (None, None)
        return cu, pos, cos, sin

    def validate(self, shape, dtype, device, extra_inputs=()):
        if len(shape) != self.input_dims or not dtype.is_floating_point:
            raise ValueError(f"{self.describe()} takes a floating input (batch, seq, features),"
                             f" got {dtype} of shape {tuple(shape)}")
        layout = self._layout(shape[-1])
        rotary = self._rotary_options(layout.head_dim)
        cu, pos, cos, sin = self._extras(extra_inputs)
        if cu is not None:
            self._check_documents(cu, shape, device)
        if pos is not None:
            checks.extra_tensor(self.describe(), pos, "the position ids", "an integer tensor "
                                "(int32 or int64)", tuple(pos.shape), _INTEGER.__contains__,
                                device)
            if tuple(pos.shape) not in (tuple(shape[:2]), (shape[1],)):
                raise ValueError(f"{self.describe()}: position_ids must be (batch, seq) = "
                                 f"{tuple(shape[:2])} or (seq,), got {tuple(pos.shape)}")
        if self.rotary_tables:
            self._check_tables(cos, sin, shape, device, rotary.rotary_dim // 2)
            if cos.shape != sin.shape:  # the kernel reads both with cos's rows
                raise ValueError(f"{self.describe()}: the rotary tables cos and sin must have "
                                 f"one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
        self._options(torch.device(device).type, dtype, layout.head_dim)
        for name in self.param_names:
            self._check_param(name, self.param(name), dtype, device, (layout.head_dim,))
        return (*shape[:2], layout.heads * layout.head_dim)

    def _check_tables(self, cos, sin, shape, device, half: int) -> None:
        b, s = shape[:2]
        allowed = ((s, half), (1, s, half), (b, s, half))
        for name, table in (("cos", cos), ("sin", sin)):
            checks.extra_tensor(self.describe(), table, f"the rotary table {name}",
                                "a floating tensor", tuple(getattr(table, "shape", ())),
                                lambda dtype: dtype.is_floating_point, device)
            if tuple(table.shape) not in allowed:
                raise ValueError(f"{self.describe()}: the rotary table {name} must be (seq, "
                                 f"rotary_dim / 2) = {allowed[0]}, {allowed[1]} or "
                                 f"{allowed[2]}, got {tuple(table.shape)}")

    def _check_documents(self, cu: Tensor, shape, device) -> None:
        checks.extra_tensor(self.describe(), cu, "cu_seqlens", "an integer tensor (int32 or "
                            "int64) of document offsets", tuple(cu.shape),
                            _INTEGER.__contains__, device)
        if shape[0] != 1 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{self.describe()}: packed documents take one row (1, T, ...) "
                             f"and cu_seqlens (documents + 1,), got an input of shape "
                             f"{tuple(shape)} and cu_seqlens of shape {tuple(cu.shape)}")

    # --- the stage

    def forward_args(self, input, params, extra_inputs, ctxs):
        layout = self._layout(input.shape[-1])
        cu, pos, cos, sin = self._extras(extra_inputs)
        qw, kw = (params[0], params[1]) if self.qk_norm else (None, None)
        return AttentionForwardArgs(input, cu, pos, cos, sin, qw, kw, layout,
                                    self._rotary_options(layout.head_dim),
                                    self._options(input.device.type, input.dtype,
                                                  layout.head_dim), float(self.qk_norm_eps),
                                    self.qk_norm_zero_centered)

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        x, layout, rotary = args.input, args.layout, _rotary(args.rotary)
        b, s = x.shape[:2]
        angles = _angles(x, rotary, args.cu_seqlens, args.position_ids, args.cos, args.sin)
        qw, kw = _gammas(args.q_norm_weight, args.k_norm_weight, args.qk_zero_centered)
        prepared, (q, k, v), q_rstd, k_rstd = qkv_prep.prepare_forward(
            x, layout, angles, rotary, qw, kw, args.eps)
        out, lse, rng = attn.attention_forward(q, k, v, args.options, args.cu_seqlens)
        # aux: distinct tensors (a custom op's results may not alias one another)
        return ForwardResult(out.view(b, s, -1), (),
                             (x.new_empty(0) if prepared is None else prepared, lse, rng,
                              x.new_empty(0) if q_rstd is None else q_rstd,
                              x.new_empty(0) if k_rstd is None else k_rstd))

    def save_for_backward(self, args, result, ctxs):
        needs = ctxs[0].needs
        if not needs.any:
            return
        prepared, lse, rng, q_rstd, k_rstd = result.aux
        keep_input = not prepared.numel() or args.q_norm_weight is not None
        ctxs[0].saved = AttentionSaved(
            args.input if keep_input else None, prepared, result.output, lse, rng, q_rstd,
            k_rstd, args.cu_seqlens, args.position_ids, args.cos, args.sin, args.q_norm_weight,
            args.k_norm_weight)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        saved, needs = ctxs[0].saved, ctxs[0].needs
        heads, kv_heads = self._local_heads()
        layout = self._layout(grad_output.shape[-1] // heads * (heads + 2 * kv_heads))
        return AttentionBackwardArgs(
            grad_output, saved.input, saved.prepared, saved.output, saved.lse,
            saved.rng_state, saved.q_rstd, saved.k_rstd, saved.cu_seqlens, saved.position_ids,
            saved.cos, saved.sin, saved.q_norm_weight, saved.k_norm_weight, layout,
            self._rotary_options(layout.head_dim),
            self._options(grad_output.device.type, grad_output.dtype, layout.head_dim),
            self.qk_norm and any(needs.params), self.qk_norm_zero_centered)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        layout, rotary = args.layout, _rotary(args.rotary)
        b, s = args.grad_output.shape[:2]
        if args.prepared.numel():
            q, k, v = qkv_prep.views(args.prepared, b, s, layout)
        else:
            q, k, v = qkv_prep.split(args.input, layout)
        dout = args.grad_output.reshape(b, s, layout.heads, layout.head_dim)
        out = args.output.view(b, s, layout.heads, layout.head_dim)
        dq, dk, dv = attn.attention_backward(dout, q, k, v, out, args.lse, args.rng_state,
                                             args.options, args.cu_seqlens)
        angles = _angles(args.grad_output, rotary, args.cu_seqlens, args.position_ids,
                         args.cos, args.sin)
        norm_saved = None
        if args.q_norm_weight is not None:
            q_in, k_in, _ = qkv_prep.split(args.input, layout)
            norm_saved = (q_in.contiguous(), k_in.contiguous(), args.q_rstd, args.k_rstd,
                          *_gammas(args.q_norm_weight, args.k_norm_weight,
                                   args.qk_zero_centered))
        dqkv, dqw, dkw = qkv_prep.prepare_backward(dq, dk, dv, layout, angles, rotary,
                                                   norm_saved, args.need_grad_norms)
        if args.q_norm_weight is not None and dqw is not None:  # d(1 + w) = dw
            dqw, dkw = dqw.to(args.q_norm_weight.dtype), dkw.to(args.k_norm_weight.dtype)
        extras = (int(args.cu_seqlens is not None) + int(args.position_ids is not None)
                  + 2 * int(args.cos is not None))
        params = (dqw, dkw) if args.q_norm_weight is not None else ()
        return BackwardResult(dqkv, params, (None,) * extras)

    # --- the reference

    def reference(self, x, extra_inputs, params):
        """Plain PyTorch: the split, the norms, :func:`apply_rotary`, and
        ``F.scaled_dot_product_attention`` with k and v repeated per query head and the
        mask given explicitly."""
        layout = self._layout(x.shape[-1])
        cu, pos_ids, cos, sin = self._extras(extra_inputs)
        q, k, v = qkv_prep.split(x, layout)
        if self.qk_norm:
            qw, kw = ((1 + params[0], 1 + params[1]) if self.qk_norm_zero_centered
                      else (params[0], params[1]))
            q, k = _rms(q, qw, self.qk_norm_eps), _rms(k, kw, self.qk_norm_eps)
        rotary = _rotary(self._rotary_options(layout.head_dim))
        if rotary is not None:
            if cos is None:
                pos = qkv_prep.positions(x.shape[0], x.shape[1], cu, pos_ids, x.device)
                cos, sin = rotary_angles(pos, rotary)
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            q, k = apply_rotary(q, cos, sin, rotary), apply_rotary(k, cos, sin, rotary)
        scale = self.softmax_scale if self.softmax_scale is not None else layout.head_dim ** -0.5
        options = attn.AttentionOptions(self.causal, scale, self.window or 0, "math")
        groups = layout.heads // layout.kv_heads
        k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
        allowed = attn.mask(x.shape[1], options, cu, x.device)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.softcap:  # Gemma 2's order: scale, cap, mask, softmax
            scores = q @ k.transpose(-1, -2) * scale
            scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores.masked_fill(~allowed, float("-inf"))
            out = torch.softmax(scores, -1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                 scale=options.scale)
        return out.transpose(1, 2).flatten(2), ()

    @classmethod
    def example(cls):
        return Example((cls(4, num_kv_heads=2, rotary_base=10000.0),), (2, 5, 64), fp8=False)


def _gammas(q_weight, k_weight, zero_centered: bool) -> tuple:
    """What the q and k norms multiply by (``1 + weight`` in float32 when zero-centred)."""
    if q_weight is None:
        return None, None
    return effective_gamma(q_weight, zero_centered), effective_gamma(k_weight, zero_centered)


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight

