"""TransformerLayer: a whole decoder (or encoder) layer as one ``ops.Sequential``, its
residuals carried through named channels, so that the planner sees the layer whole:
the norms' kernels take the residual branches' gradients, the output projections add
their residuals in their GEMMs' epilogues where a fusion does, and the layer is one
group in ``plan_model``."""

from __future__ import annotations

import collections
from typing import Any, Optional

from fusible.core import checks
from fusible.core.arg_types import DTypeArg, DeviceArg, GroupArg
from fusible.functional import parallel
from fusible import ops

NORMS = ("rmsnorm", "layernorm")
ACTIVATIONS = {"swiglu": 2, "geglu": 2, "gelu": 1, "gelu_tanh": 1, "relu": 1, "silu": 1}
RESIDUALS = ("pre_norm", "post_norm", "parallel", "parallel_shared_norm", "sandwich")


def _activation(name: str, glu_interleave_size: Optional[int] = None,
                recompute_output: bool = False):
    gated: dict[str, Any] = {"glu_interleave_size": glu_interleave_size,
                             "recompute_output": recompute_output}
    return {"swiglu": lambda: ops.SwiGLU(**gated), "geglu": lambda: ops.GEGLU(**gated),
            "gelu": lambda: ops.GELU(), "gelu_tanh": lambda: ops.GELU(approximate="tanh"),
            "relu": lambda: ops.ReLU(), "silu": lambda: ops.SiLU()}[name]()


class TransformerLayer(ops.Sequential):
    """A transformer layer: self-attention and a feed-forward block, each with its norm
    and residual, as one pipeline called ``layer(x)`` on ``(batch, seq, hidden_size)``.

    ``residual="pre_norm"`` (Llama, Mistral, Qwen, GPT-2)::

        h = x + proj(attention(qkv(norm1(x))))
        y = h + fc2(act(fc1(norm2(h))))

    ``residual="post_norm"`` (BERT)::

        h = norm1(x + proj(attention(qkv(x))))
        y = norm2(h + fc2(act(fc1(h))))

    ``residual="parallel"`` (GPT-NeoX) and ``"parallel_shared_norm"`` (GPT-J, Phi-2: one
    norm, ``norm2`` is ``norm1``)::

        y = x + proj(attention(qkv(norm1(x)))) + fc2(act(fc1(norm2(x))))

    ``residual="sandwich"`` (Gemma 2 and 3: a norm after each branch too, modules
    ``post_attention_norm`` and ``post_mlp_norm``)::

        h = x + norm3(proj(attention(qkv(norm1(x)))))
        y = h + norm4(fc2(act(fc1(norm2(h)))))

    The modules are named ``input_norm`` (pre-norm, parallel), ``qkv``, ``attention``,
    ``proj``, ``mlp_norm`` (not with a shared norm), ``fc1``, ``activation``, ``fc2``
    (post-norm: ``attention_norm`` after the attention's residual, ``output_norm`` at the
    end), which are also their state-dict prefixes; ``qkv.weight`` stacks the query, key and value projections' rows
    in that order, ``fc1.weight`` a gated activation's gate rows then its up rows.

    Parameters
    ----------
    hidden_size, ffn_hidden_size, num_heads : int
    num_kv_heads : int, optional
        Grouped-query attention's key/value heads (``num_heads`` when None).
    norm : {"rmsnorm", "layernorm"}
    activation : {"swiglu", "geglu", "gelu", "gelu_tanh", "relu", "silu"}
        Gated activations double ``fc1``'s output (``[gate | up]``).
    rotary_base : float, optional
        The rotary embedding's base (None: no rotary embedding).
    causal : bool
    residual : {"pre_norm", "post_norm", "parallel", "parallel_shared_norm", "sandwich"}
    zero_centered_gamma : bool
        The norms scale by ``1 + weight`` (Gemma's), their weights starting at zero.
    head_dim : int, optional
        ``hidden_size // num_heads`` when None.
    eps : float
        The norms' epsilon.
    bias : bool
        Biases in the four linear layers.
    recompute_activation : bool
        A gated activation's output is not saved for ``fc2``'s weight gradient but
        recomputed in the backward by the kernel of its own gradient (the gated unit's
        ``recompute_output``, the joint fusion ``RecomputeGluLinear``): ``tokens x
        ffn_hidden_size`` less memory between the passes per layer, for one more write.
        High precision only: under FP8, with tensor parallelism, under a split backward
        and where ``fc2``'s weight is frozen the ops run as their own stages, the plan
        saying why.
    qkv_bias : bool, optional
        A bias in the QKV projection alone (Qwen2); ``bias`` when None.
    tensor_parallel : bool
        Megatron's tensor parallelism over ``tensor_parallel_group``: ``qkv`` and ``fc1``
        column-parallel, the heads split (``ops.Attention(tensor_parallel=True)``),
        ``proj`` and ``fc2`` row-parallel. The global rows of ``qkv`` are then laid out
        rank by rank (:func:`qkv_rows_by_rank`) and a gated ``fc1``'s interleaved in
        blocks of ``ffn_hidden_size / world_size`` (:func:`fusible.interleave_glu_rows`):
        shard a whole layer's state dict with both, then take each rank's rows.
    tensor_parallel_group : ProcessGroup or 1-D DeviceMesh, optional
        The default group when None.
    sequence_parallel : bool
        With ``tensor_parallel``: dim 0 of the input (the batch rows of ``(B, S,
        hidden)``, which the attention takes whole: the QKV projection all-gathers them)
        split over the group between the layers and around the norms.
    device, dtype
        Of the parameters.
    **attention_options
        Passed to :class:`fusible.ops.Attention` (``rotary_interleaved``,
        ``rotary_fraction``, ``rotary_scaling``, ``softmax_scale``, ``qk_norm``,
        ``window``, ``documents``, ``position_ids``, ``backend``): with ``documents`` or
        ``position_ids`` the layer is called ``layer(x, cu_seqlens)`` /
        ``layer(x, position_ids)``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_heads: int, *,
                 num_kv_heads: Optional[int] = None, norm: str = "rmsnorm",
                 activation: str = "swiglu", rotary_base: Optional[float] = 10000.0,
                 causal: bool = True, residual: str = "pre_norm",
                 zero_centered_gamma: bool = False,
                 head_dim: Optional[int] = None, eps: float = 1e-5, bias: bool = False,
                 qkv_bias: Optional[bool] = None, recompute_activation: bool = True,
                 tensor_parallel: bool = False,
                 tensor_parallel_group: GroupArg = None, sequence_parallel: bool = False,
                 device: DeviceArg = None, dtype: DTypeArg = None, **attention_options):
        name = "TransformerLayer"
        for arg, value in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                           ("num_heads", num_heads)):
            checks.positive_int(arg)(name, value)
        checks.one_of("norm", NORMS)(name, norm)
        checks.one_of("activation", tuple(ACTIVATIONS))(name, activation)
        checks.one_of("residual", RESIDUALS)(name, residual)
        checks.boolean("recompute_activation")(name, recompute_activation)
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"{name}: hidden_size {hidden_size} is not a multiple of "
                                 f"num_heads {num_heads}; give head_dim")
            head_dim = hidden_size // num_heads
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        checks.boolean("tensor_parallel")(name, tensor_parallel)
        if not tensor_parallel and (sequence_parallel or tensor_parallel_group is not None):
            raise ValueError(f"{name}: sequence_parallel and tensor_parallel_group need "
                             f"tensor_parallel=True")
        group: dict[str, Any] = ({"tensor_parallel_group": tensor_parallel_group}
                                 if tensor_parallel else {})
        split: dict[str, Any] = ({"sequence_parallel": sequence_parallel, **group}
                 if tensor_parallel and sequence_parallel else {})
        world_size = (parallel.group_config(name, "column", False, tensor_parallel_group)
                      .world_size if tensor_parallel else 1)

        def make_norm():
            cls = ops.RMSNorm if norm == "rmsnorm" else ops.LayerNorm
            return cls(hidden_size, eps=eps, zero_centered_gamma=zero_centered_gamma, **split,
                       **factory)

        def linear(n_in, n_out, with_bias, mode):
            tp = ({"tensor_parallel_mode": mode, "sequence_parallel": sequence_parallel,
                   **group} if tensor_parallel else {})
            return ops.Linear(n_in, n_out, bias=with_bias, **tp, **factory)

        attention = [
            ("qkv", linear(hidden_size, (num_heads + 2 * kv_heads) * head_dim,
                           bias if qkv_bias is None else qkv_bias, "column")),
            ("attention", ops.Attention(num_heads, num_kv_heads=kv_heads, causal=causal,
                                        rotary_base=rotary_base, head_dim=head_dim,
                                        tensor_parallel=tensor_parallel, **group,
                                        **attention_options, **factory)),
            ("proj", linear(num_heads * head_dim, hidden_size, bias, "row"))]
        gated = ACTIVATIONS[activation] == 2
        interleave = ffn_hidden_size // world_size if gated and tensor_parallel else None
        mlp = [("fc1", linear(hidden_size, ACTIVATIONS[activation] * ffn_hidden_size, bias,
                              "column")),
               ("activation", _activation(activation, interleave,
                                          gated and recompute_activation)),
               ("fc2", linear(ffn_hidden_size, hidden_size, bias, "row"))]

        def branch(tag):
            return ops.MakeExtraOutput(channel=tag)

        def add(tag):
            return ops.AddExtraInput(channel=tag)

        if residual == "pre_norm":
            modules = [("attention_residual", branch("attention")),
                       ("input_norm", make_norm()), *attention,
                       ("attention_add", add("attention")),
                       ("mlp_residual", branch("mlp")), ("mlp_norm", make_norm()), *mlp,
                       ("mlp_add", add("mlp"))]
        elif residual == "sandwich":
            modules = [("attention_residual", branch("attention")),
                       ("input_norm", make_norm()), *attention,
                       ("post_attention_norm", make_norm()),
                       ("attention_add", add("attention")),
                       ("mlp_residual", branch("mlp")), ("mlp_norm", make_norm()), *mlp,
                       ("post_mlp_norm", make_norm()), ("mlp_add", add("mlp"))]
        elif residual == "post_norm":
            modules = [("attention_residual", branch("attention")), *attention,
                       ("attention_add", add("attention")), ("attention_norm", make_norm()),
                       ("mlp_residual", branch("mlp")), *mlp, ("mlp_add", add("mlp")),
                       ("output_norm", make_norm())]
        else:  # the MLP branch resumes from the layer's (normed) input after attention's
            shared = residual == "parallel_shared_norm"
            before = [("input_norm", make_norm())] if shared else []
            after = [] if shared else [("input_norm", make_norm())]
            modules = [("attention_residual", branch("attention")), *before,
                       ("mlp_residual", branch("mlp")), *after, *attention,
                       ("attention_add", add("attention")),
                       ("mlp_resume", ops.ResumeFromChannel("mlp", keep_as="branches")),
                       *([] if shared else [("mlp_norm", make_norm())]), *mlp,
                       ("mlp_add", add("branches"))]
        super().__init__(collections.OrderedDict(modules))  # type: ignore[arg-type]
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.norm_type, self.activation_type, self.residual = norm, activation, residual
        self.tensor_parallel, self.world_size = tensor_parallel, world_size
