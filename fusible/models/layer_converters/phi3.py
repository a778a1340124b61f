"""Phi-3 decoder layers: Llama's, with the q/k/v and gate/up projections fused into one
weight each (``qkv_proj``, ``gate_up_proj``: TransformerLayer's layout, nothing to
concatenate) and residual dropouts."""

from __future__ import annotations

from typing import Any, Union

from fusible.models.layer_converter import NO_CONFIG, LayerConverter, common_spec, has_children

_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm",
             "resid_attn_dropout", "resid_mlp_dropout"}


class Phi3Layers(LayerConverter):
    name = "phi3"

    def recognise(self, layer: Any) -> Union[None, str, dict]:
        attn: Any = getattr(layer, "self_attn", None)
        mlp: Any = getattr(layer, "mlp", None)
        if not (has_children(layer, _CHILDREN) and has_children(attn, ("qkv_proj", "o_proj"))
                and has_children(mlp, ("gate_up_proj", "down_proj"), ("activation_fn",))):
            return None
        config: Any = getattr(attn, "config", None)
        if config is None:
            return NO_CONFIG
        if any(m.bias is not None for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                            mlp.down_proj)):
            return "biases in its projections (Phi-3 has none)"
        common = common_spec(config, (layer.input_layernorm, layer.post_attention_layernorm),
                             attn.o_proj.in_features)
        if isinstance(common, str):
            return common
        return dict(hidden_size=attn.o_proj.out_features,
                    ffn_hidden_size=mlp.down_proj.in_features,
                    num_kv_heads=config.num_key_value_heads, **common)

    def parameters(self, layer: Any, spec: dict) -> dict:
        return {"input_norm.weight": layer.input_layernorm.weight,
                "mlp_norm.weight": layer.post_attention_layernorm.weight,
                "qkv.weight": layer.self_attn.qkv_proj.weight,
                "proj.weight": layer.self_attn.o_proj.weight,
                "fc1.weight": layer.mlp.gate_up_proj.weight,
                "fc2.weight": layer.mlp.down_proj.weight}
