"""GPT-2 blocks: pre-norm LayerNorms, ``Conv1D`` projections (a linear layer's weight
stored transposed: read as the transposed view, no copy), the fused QKV projection in
TransformerLayer's layout, a GELU(tanh) MLP, biases, no rotary embedding (the model adds
learned positions before the first block)."""

from __future__ import annotations

from typing import Any, Union

from fusible.models.layer_converter import NO_CONFIG, LayerConverter, has_children, shared_eps

_CHILDREN = {"ln_1", "attn", "ln_2", "mlp"}
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu": "relu", "silu": "silu"}


def _conv1d(module) -> bool:
    """A transformers ``Conv1D``: ``weight`` (in, out) and ``bias`` (out,)."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
        and getattr(module, "bias", None) is not None


class GPT2Layers(LayerConverter):
    name = "gpt2"

    def recognise(self, layer: Any) -> Union[None, str, dict]:
        attn: Any = getattr(layer, "attn", None)
        mlp: Any = getattr(layer, "mlp", None)
        if not (has_children(layer, _CHILDREN)
                and has_children(attn, ("c_attn", "c_proj", "attn_dropout", "resid_dropout"))
                and has_children(mlp, ("c_fc", "c_proj", "act", "dropout"))
                and all(_conv1d(m) for m in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj))):
            return None
        config: Any = getattr(attn, "config", None)
        if config is None:
            return NO_CONFIG
        if getattr(attn, "scale_attn_by_inverse_layer_idx", False) or \
                getattr(attn, "reorder_and_upcast_attn", False):
            return "scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn"
        activation = _ACTIVATIONS.get(str(getattr(config, "activation_function", None)))
        if activation is None:
            return f"its activation {config.activation_function!r} (fused: {sorted(_ACTIVATIONS)})"
        eps = shared_eps(layer.ln_1, layer.ln_2)
        if isinstance(eps, str):
            return eps
        hidden, heads = attn.c_proj.weight.shape[1], attn.num_heads
        spec = dict(hidden_size=hidden, ffn_hidden_size=mlp.c_fc.weight.shape[1],
                    num_heads=heads, head_dim=hidden // heads, norm="layernorm",
                    activation=activation, eps=eps, bias=True, rotary_base=None)
        if not getattr(attn, "scale_attn_weights", True):
            spec["softmax_scale"] = 1.0
        return spec

    def parameters(self, layer: Any, spec: dict) -> dict:
        attn, mlp = layer.attn, layer.mlp
        return {"input_norm.weight": layer.ln_1.weight, "input_norm.bias": layer.ln_1.bias,
                "mlp_norm.weight": layer.ln_2.weight, "mlp_norm.bias": layer.ln_2.bias,
                "qkv.weight": attn.c_attn.weight.t(), "qkv.bias": attn.c_attn.bias,
                "proj.weight": attn.c_proj.weight.t(), "proj.bias": attn.c_proj.bias,
                "fc1.weight": mlp.c_fc.weight.t(), "fc1.bias": mlp.c_fc.bias,
                "fc2.weight": mlp.c_proj.weight.t(), "fc2.bias": mlp.c_proj.bias}
