"""GPT-NeoX decoder layers (Pythia): LayerNorms, a fused QKV projection laid out per head
(q, k, v of head 0, then head 1, ...: reordered on each call to TransformerLayer's q
heads, k heads, v heads), partial rotary, a plain GELU MLP, biases, and the parallel
residual (``use_parallel_residual``) or the sequential one."""

from __future__ import annotations

from typing import Any, Union

from fusible.models.layer_converter import NO_CONFIG, LayerConverter, common_spec, has_children

_CHILDREN = {"input_layernorm", "post_attention_layernorm", "post_attention_dropout",
             "post_mlp_dropout", "attention", "mlp"}
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "relu": "relu", "silu": "silu"}


class GPTNeoXLayers(LayerConverter):
    name = "gpt_neox"
    cache_kwargs = ("layer_past", "cache", "past_key_values")

    def recognise(self, layer: Any) -> Union[None, str, dict]:
        attn: Any = getattr(layer, "attention", None)
        mlp: Any = getattr(layer, "mlp", None)
        if not (has_children(layer, _CHILDREN)
                and has_children(attn, ("query_key_value", "dense"))
                and has_children(mlp, ("dense_h_to_4h", "dense_4h_to_h"), ("act",))):
            return None
        config: Any = getattr(attn, "config", None)
        if config is None:
            return NO_CONFIG
        activation = _ACTIVATIONS.get(str(getattr(config, "hidden_act", None)))
        if activation is None:
            return f"its activation {config.hidden_act!r} (fused: {sorted(_ACTIVATIONS)})"
        if attn.query_key_value.bias is None or attn.dense.bias is None:
            return "attention_bias=False: its MLP has biases, its attention none"
        common = common_spec(config, (layer.input_layernorm, layer.post_attention_layernorm),
                             attn.dense.in_features)
        if isinstance(common, str):
            return common
        return dict(hidden_size=attn.dense.out_features,
                    ffn_hidden_size=mlp.dense_h_to_4h.out_features, norm="layernorm",
                    activation=activation, bias=True, residual="parallel"
                    if layer.use_parallel_residual else "pre_norm", **common)

    def parameters(self, layer: Any, spec: dict) -> dict:
        attn, mlp = layer.attention, layer.mlp
        heads = spec["num_heads"]
        w, b = attn.query_key_value.weight, attn.query_key_value.bias
        return {"input_norm.weight": layer.input_layernorm.weight,
                "input_norm.bias": layer.input_layernorm.bias,
                "mlp_norm.weight": layer.post_attention_layernorm.weight,
                "mlp_norm.bias": layer.post_attention_layernorm.bias,
                "qkv.weight": w.view(heads, 3, -1, w.shape[-1]).transpose(0, 1)
                               .reshape(w.shape),
                "qkv.bias": b.view(heads, 3, -1).transpose(0, 1).reshape(b.shape),
                "proj.weight": attn.dense.weight, "proj.bias": attn.dense.bias,
                "fc1.weight": mlp.dense_h_to_4h.weight, "fc1.bias": mlp.dense_h_to_4h.bias,
                "fc2.weight": mlp.dense_4h_to_h.weight, "fc2.bias": mlp.dense_4h_to_h.bias}
