"""Whole Hugging Face decoder layers as one fusible plan: :func:`fuse_decoder_layer`
recognises a Llama-style layer (Llama, Mistral, Qwen2, Qwen3: pre-norm RMSNorm, q/k/v/o
projections, a gated MLP with gate/up/down projections) by its structure and confirms it
by computing it both ways on a probe input, then installs a forward on the instance that
runs the layer as a :class:`fusible.layers.TransformerLayer`.

The layer keeps its class, children and parameters: the fused forward calls the
TransformerLayer (built on the meta device, holding nothing) with the layer's own
parameters through ``torch.func.functional_call``, the q/k/v and gate/up weights
concatenated by autograd on each call (so an optimizer built before the conversion keeps
training the original parameter objects, and state dicts keep their keys). Calls the fused
layer does not compute (a KV cache, an attention mask, attention weights asked for,
packed-sequence arguments, positional arguments) run the original forward, the reason
counted in ``forward.fallbacks``.
"""

from __future__ import annotations

import collections
import copy
import weakref
from typing import Any, Optional, Union

import torch
from torch import nn

from fusible.functional.rotary import RotaryOptions, rotary_angles
from fusible.layers.transformer_layer import TransformerLayer

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_ROPE_TYPES = ("default", "llama3")
# The probe's tolerance, relative to the largest value the layer adds to its input:
# Hugging Face computes its norms in float32 whatever the dtype
_PROBE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4}  # 16-bit: probed in float32
# Keyword arguments the fused layer takes (or that mean nothing without a cache)
_TAKEN = frozenset({"attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                    "position_embeddings", "cache_position", "output_attentions"})
FALLBACKS = ("falls back to the original code for a KV cache, an attention mask (padding; "
             "the eager attention's causal mask), output_attentions and packed-sequence "
             "arguments")


def fuse_decoder_layer(layer: nn.Module) -> Union[None, str, "FusedLayerForward"]:
    """Install the fused forward on ``layer`` if it is a Llama-style decoder layer.

    Returns
    -------
    None, str or FusedLayerForward
        None: not a decoder layer of this shape; a str: one, left as it is for that
        reason; the installed forward otherwise.
    """
    if not _shaped_like_llama(layer):
        return None
    if "forward" in layer.__dict__:
        return "its forward was replaced already"
    spec = _spec(layer)
    if isinstance(spec, str):
        return spec
    fused = FusedLayerForward(layer, spec, layer.input_layernorm.weight.dtype)
    why = fused.probe()
    if why:
        return why
    layer.forward = fused
    return fused


def _shaped_like_llama(layer: nn.Module) -> bool:
    """The children of a Llama-style layer and nothing else (what the fused layer would
    leave out, the probe could miss)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (attn is not None and mlp is not None
            and all(isinstance(getattr(attn, n, None), nn.Linear) for n in _ATTENTION)
            and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in _MLP)
            and all(isinstance(getattr(getattr(layer, n, None), "weight", None), nn.Parameter)
                    for n in ("input_layernorm", "post_attention_layernorm"))
            and set(layer._modules) == {"self_attn", "mlp", "input_layernorm",
                                        "post_attention_layernorm"}
            and set(attn._modules) <= {*_ATTENTION, "q_norm", "k_norm"}
            and set(mlp._modules) <= {*_MLP, "act_fn"})


def _eps(norm: nn.Module) -> Optional[float]:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _spec(layer: nn.Module) -> Union[str, dict]:
    """TransformerLayer's arguments for ``layer``, or why there are none."""
    attn, mlp = layer.self_attn, layer.mlp
    config = getattr(attn, "config", None)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if config is None or "rope_theta" not in rope:
        return "its attention has no config with rope_parameters (rope_theta) to read"
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        return f"its rotary embedding is rope_type {rope_type!r} (fused: {_ROPE_TYPES})"
    if getattr(attn, "attention_dropout", 0.0):
        return f"attention dropout {attn.attention_dropout} (the fused attention has none)"
    eps = _eps(layer.input_layernorm)
    if eps is None or _eps(layer.post_attention_layernorm) != eps:
        return "its two norms' epsilons differ or cannot be read"
    biases = {n: getattr(attn, n).bias is not None for n in _ATTENTION}
    mlp_bias = [getattr(mlp, n).bias is not None for n in _MLP]
    if len(set(biases[n] for n in _ATTENTION[:3])) > 1 or len(set(mlp_bias)) > 1 or \
            biases["o_proj"] != mlp_bias[0]:
        return (f"its biases ({biases}, MLP {mlp_bias}) are not one QKV setting and one for "
                f"the output projection and the MLP")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = attn.q_proj.out_features // heads
    qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    options: dict[str, Any] = dict(
        hidden_size=attn.q_proj.in_features, ffn_hidden_size=mlp.gate_proj.out_features,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rotary_base=float(rope["rope_theta"]), eps=eps, bias=biases["o_proj"],
        qkv_bias=biases["q_proj"], position_ids=True,
        rotary_fraction=float(rope.get("partial_rotary_factor", 1.0)))
    if rope_type == "llama3":
        options["rotary_scaling"] = dict(rope, rope_type="llama3")
    if qk_norm:
        options.update(qk_norm=True, qk_norm_eps=_eps(attn.q_norm))
    scale = getattr(attn, "scaling", head_dim ** -0.5)
    if abs(scale - head_dim ** -0.5) > 1e-12:
        options["softmax_scale"] = float(scale)
    return options


class FusedLayerForward:
    """The forward :func:`fuse_decoder_layer` installs: the layer as one
    TransformerLayer where the call allows, the original forward otherwise.

    Attributes
    ----------
    fused : TransformerLayer
        On the meta device; called with the layer's parameters.
    fallbacks : collections.Counter
        Why calls ran the original forward, and how many.
    """

    def __init__(self, layer: nn.Module, spec: dict, dtype: torch.dtype):
        self._layer = weakref.ref(layer)  # no reference cycle; and unpickling, the layer
        self.spec, self.dtype = spec, dtype  # is not whole yet: nothing read from it here
        self.fused = TransformerLayer(**spec, device="meta", dtype=dtype)
        self.fallbacks: collections.Counter = collections.Counter()

    def _owner(self) -> nn.Module:
        layer = self._layer()
        if layer is None:
            raise ReferenceError("the layer of this fused forward no longer exists")
        return layer

    def __call__(self, hidden_states, *args, **kwargs):
        layer = self._owner()
        why = _fallback_reason(args, kwargs)
        if why is not None:
            self.fallbacks[why] += 1
            return type(layer).forward(layer, hidden_states, *args, **kwargs)
        return self.run(layer, hidden_states, kwargs.get("position_ids"))

    def run(self, layer: nn.Module, hidden_states, position_ids=None):
        """The fused computation on ``(batch, seq, hidden)`` at ``position_ids``."""
        seq = hidden_states.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden_states.device)
        elif position_ids.shape[0] == 1:
            position_ids = position_ids[0]
        self.fused.train(layer.training)
        return torch.func.functional_call(self.fused, layer_parameters(layer, self.spec),
                                          (hidden_states, position_ids))

    def probe(self) -> Optional[str]:
        """Compute a random input both ways; why they differ, or None. A 16-bit layer is
        probed as a float32 copy: what it adds to its input (small next to the input at
        initialisation) would drown in the output's rounding."""
        layer = self._owner()
        weight = layer.input_layernorm.weight
        if weight.device.type == "meta":
            return "its parameters are on the meta device: nothing to probe them with"
        if weight.dtype in (torch.bfloat16, torch.float16):
            probed = copy.deepcopy(layer).float()
            return FusedLayerForward(probed, self.spec, torch.float32).probe()
        tolerance = _PROBE_TOLERANCE.get(weight.dtype)
        if tolerance is None:
            return f"no probe tolerance for {weight.dtype}"
        generator = torch.Generator(weight.device).manual_seed(0)
        x = torch.randn(2, 8, self.spec["hidden_size"], generator=generator,
                        device=weight.device).to(weight.dtype)
        positions = torch.arange(8, device=weight.device)
        with torch.no_grad():
            want = type(layer).forward(layer, x, position_ids=positions[None],
                                       attention_mask=_causal_mask(layer, 8, x),
                                       position_embeddings=_hf_tables(self.spec, positions,
                                                                      weight.dtype))
            want = want[0] if isinstance(want, tuple) else want
            got = self.run(layer, x, positions[None])
        # against what the layer adds to its input: the residual would hide the rest
        error = (got.double() - want.double()).abs().max().item()
        bound = tolerance * (want.double() - x.double()).abs().max().item()
        if not error <= bound:
            return (f"it computes other than the fused layer on a probe input (max error "
                    f"{error:.3g}, tolerance {bound:.3g}: {tolerance} of the largest value "
                    f"the layer adds to its input)")
        return None

    def __deepcopy__(self, memo: dict) -> "FusedLayerForward":
        new = copy.copy(self)
        new._layer = weakref.ref(copy.deepcopy(self._owner(), memo))
        new.fused = copy.deepcopy(self.fused, memo)
        new.fallbacks = collections.Counter()
        return new

    def __reduce__(self):
        return FusedLayerForward, (self._owner(), self.spec, self.dtype)


def _fallback_reason(args: tuple, kwargs: dict) -> Optional[str]:
    if args:
        return "positional arguments after hidden_states"
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            return "a KV cache"
    if kwargs.get("attention_mask") is not None:
        return "an attention mask"
    if kwargs.get("output_attentions"):
        return "output_attentions"
    other = sorted(k for k, v in kwargs.items() if k not in _TAKEN and v is not None)
    if other:
        return f"keyword arguments the fused layer does not take ({', '.join(other)})"
    return None


def layer_parameters(layer: nn.Module, spec: dict) -> dict:
    """The TransformerLayer's parameters from the layer's own: the q/k/v and gate/up
    weights (and biases) concatenated, the others as they are."""
    attn, mlp = layer.self_attn, layer.mlp
    params = {"input_norm.weight": layer.input_layernorm.weight,
              "mlp_norm.weight": layer.post_attention_layernorm.weight,
              "qkv.weight": torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                       attn.v_proj.weight]),
              "proj.weight": attn.o_proj.weight,
              "fc1.weight": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
              "fc2.weight": mlp.down_proj.weight}
    if spec["qkv_bias"]:
        params["qkv.bias"] = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    if spec["bias"]:
        params.update({"proj.bias": attn.o_proj.bias, "fc2.bias": mlp.down_proj.bias,
                       "fc1.bias": torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])})
    if spec.get("qk_norm"):
        params.update({"attention.q_norm_weight": attn.q_norm.weight,
                       "attention.k_norm_weight": attn.k_norm.weight})
    return params


def _causal_mask(layer: nn.Module, seq: int, x) -> Optional[torch.Tensor]:
    """The mask the model would pass to the layer for a causal batch without padding:
    None, which the sdpa and flash kernels read as causal, or (eager attention) the
    additive ``(1, 1, S, S)`` mask."""
    if getattr(layer.self_attn.config, "_attn_implementation", None) != "eager":
        return None
    blocked = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
    return torch.zeros(seq, seq, dtype=x.dtype, device=x.device).masked_fill(
        blocked, torch.finfo(x.dtype).min)[None, None]


def _hf_tables(spec: dict, positions, dtype) -> tuple:
    """Hugging Face's rotary tables ``(cos, sin)`` ``(1, S, rotary_dim)`` (both halves
    alike), for the probe."""
    rotary_dim = int(round(spec["head_dim"] * spec["rotary_fraction"]))
    scaling = spec.get("rotary_scaling") or {}
    options = RotaryOptions(spec["rotary_base"], rotary_dim, False,
                            float(scaling.get("factor", 1.0)),
                            float(scaling.get("low_freq_factor", 1.0)),
                            float(scaling.get("high_freq_factor", 4.0)),
                            int(scaling.get("original_max_position_embeddings", 8192)))
    cos, sin = rotary_angles(positions, options)
    return (torch.cat((cos, cos), -1)[None].to(dtype), torch.cat((sin, sin), -1)[None].to(dtype))
