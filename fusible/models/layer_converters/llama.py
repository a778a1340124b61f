"""Llama-style Hugging Face decoder layers (Llama, Mistral, Qwen2, Qwen3): pre-norm
RMSNorms, separate q/k/v/o projections (Qwen2's q/k/v biases, Qwen3's per-head q/k
norms), a gated MLP with gate/up/down projections."""

from __future__ import annotations

from typing import Any, Union

from torch import nn

from fusible.models.layer_converter import (NO_CONFIG, LayerConverter, common_spec,
                                            has_children, norm_eps, separate_projections)

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class LlamaLayers(LayerConverter):
    """The layers' q/k/v and gate/up weights are concatenated on each call (autograd
    hands the gradients back to the separate weights)."""

    name = "llama"

    def recognise(self, layer: Any) -> Union[None, str, dict]:
        if not shaped_like_llama(layer):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        config: Any = getattr(attn, "config", None)
        if config is None:
            return NO_CONFIG
        biases = {n: getattr(attn, n).bias is not None for n in _ATTENTION}
        mlp_bias = [getattr(mlp, n).bias is not None for n in _MLP]
        if len({biases[n] for n in _ATTENTION[:3]}) > 1 or len(set(mlp_bias)) > 1 or \
                biases["o_proj"] != mlp_bias[0]:
            return (f"its biases ({biases}, MLP {mlp_bias}) are not one QKV setting and one "
                    f"for the output projection and the MLP")
        common = common_spec(config, (layer.input_layernorm, layer.post_attention_layernorm),
                             attn.q_proj.out_features)
        if isinstance(common, str):
            return common
        spec: dict[str, Any] = dict(
            hidden_size=attn.q_proj.in_features, ffn_hidden_size=mlp.gate_proj.out_features,
            num_kv_heads=config.num_key_value_heads, bias=biases["o_proj"],
            qkv_bias=biases["q_proj"], **common)
        if hasattr(attn, "q_norm"):
            spec.update(qk_norm=True, qk_norm_eps=norm_eps(attn.q_norm))
        head_dim = spec["head_dim"]
        scale = getattr(attn, "scaling", head_dim ** -0.5)
        if abs(scale - head_dim ** -0.5) > 1e-12:
            spec["softmax_scale"] = float(scale)
        return spec

    def joined_groups(self, layer: Any) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        return (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)

    def parameters(self, layer: Any, spec: dict) -> dict:
        attn, mlp = layer.self_attn, layer.mlp
        return separate_projections(
            spec, layer.input_layernorm, layer.post_attention_layernorm,
            (attn.q_proj, attn.k_proj, attn.v_proj), attn.o_proj, (mlp.gate_proj, mlp.up_proj),
            mlp.down_proj, (attn.q_norm, attn.k_norm) if spec.get("qk_norm") else ())


def shaped_like_llama(layer: Any) -> bool:
    """The children of a Llama-style layer and nothing else (what the fused layer would
    leave out, the probe could miss)."""
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    return (has_children(layer, ("self_attn", "mlp", "input_layernorm",
                                 "post_attention_layernorm"))
            and has_children(attn, _ATTENTION, ("q_norm", "k_norm"))
            and has_children(mlp, _MLP, ("act_fn",))
            and all(isinstance(getattr(attn, n), nn.Linear) for n in _ATTENTION)
            and all(isinstance(getattr(mlp, n), nn.Linear) for n in _MLP)
            and all(isinstance(getattr(getattr(layer, n), "weight", None), nn.Parameter)
                    for n in ("input_layernorm", "post_attention_layernorm")))
