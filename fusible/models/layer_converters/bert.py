"""BERT encoder layers (and RoBERTa's, which are BERT's): post-norm LayerNorms, separate
query/key/value projections with biases, bidirectional attention (causal for BERT used as a
decoder), a GELU MLP, no rotary embedding (the model adds learned positions first)."""

from __future__ import annotations

from typing import Any, Union

from fusible.models.joined_weights import joined
from fusible.models.layer_converter import (NO_CONFIG, LayerConverter, causal_mask,
                                            has_children, shared_eps)

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu"}


class BertLayers(LayerConverter):
    name = "bert"

    def recognise(self, layer: Any) -> Union[None, str, dict]:
        attention: Any = layer._modules.get("attention")
        if not (has_children(layer, ("attention", "intermediate", "output"))
                and has_children(attention, ("self", "output"))
                and has_children(attention.self, ("query", "key", "value", "dropout"))
                and has_children(attention.output, ("dense", "LayerNorm", "dropout"))
                and has_children(layer.output, ("dense", "LayerNorm", "dropout"))):
            return None
        config: Any = getattr(attention.self, "config", None)
        if config is None:
            return NO_CONFIG
        if getattr(layer, "chunk_size_feed_forward", 0):
            return "chunk_size_feed_forward (the MLP run in chunks of tokens)"
        activation = _ACTIVATIONS.get(str(getattr(config, "hidden_act", None)))
        if activation is None:
            return f"its activation {config.hidden_act!r} (fused: {sorted(_ACTIVATIONS)})"
        eps = shared_eps(attention.output.LayerNorm, layer.output.LayerNorm)
        if isinstance(eps, str):
            return eps
        heads = config.num_attention_heads
        hidden = attention.self.query.in_features
        return dict(hidden_size=hidden, ffn_hidden_size=layer.intermediate.dense.out_features,
                    num_heads=heads, head_dim=hidden // heads, norm="layernorm",
                    activation=activation, eps=eps, bias=True, rotary_base=None,
                    causal=bool(getattr(attention.self, "is_causal", False)),
                    residual="post_norm")

    def joined_groups(self, layer: Any) -> tuple:
        own = layer.attention.self
        return ((own.query, own.key, own.value),)

    def parameters(self, layer: Any, spec: dict) -> dict:
        attn = layer.attention
        q, k, v = attn.self.query, attn.self.key, attn.self.value
        return {"qkv.weight": joined([q.weight, k.weight, v.weight]),
                "qkv.bias": joined([q.bias, k.bias, v.bias]),
                "proj.weight": attn.output.dense.weight, "proj.bias": attn.output.dense.bias,
                "attention_norm.weight": attn.output.LayerNorm.weight,
                "attention_norm.bias": attn.output.LayerNorm.bias,
                "fc1.weight": layer.intermediate.dense.weight,
                "fc1.bias": layer.intermediate.dense.bias,
                "fc2.weight": layer.output.dense.weight, "fc2.bias": layer.output.dense.bias,
                "output_norm.weight": layer.output.LayerNorm.weight,
                "output_norm.bias": layer.output.LayerNorm.bias}

    def probe_kwargs(self, layer, spec, x, positions) -> dict:
        return {"attention_mask": causal_mask(layer, x) if spec["causal"] else None}
