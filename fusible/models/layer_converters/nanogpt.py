"""nanoGPT-style blocks (Karpathy's ``model.py``): ``ln_1``, ``attn`` (``c_attn`` one
``nn.Linear`` for q, k and v, ``c_proj``, ``n_head``), ``ln_2``, ``mlp`` (``c_fc``, ``gelu``,
``c_proj``); its own LayerNorm class (epsilon 1e-5 written in its forward, confirmed by the
probe), biases (``bias=True``), a causal attention without rotary embedding."""

from __future__ import annotations

from typing import Any, Union

from torch import nn

from fusible.models.layer_converter import LayerConverter, has_children, norm_eps

_DEFAULT_EPS = 1e-5  # nanoGPT's LayerNorm passes it to F.layer_norm; the probe checks it


class NanoGPTLayers(LayerConverter):
    name = "nanogpt"

    def recognise(self, layer: Any) -> Union[None, str, dict]:
        attn: Any = getattr(layer, "attn", None)
        mlp: Any = getattr(layer, "mlp", None)
        if not (has_children(layer, ("ln_1", "attn", "ln_2", "mlp"))
                and has_children(attn, ("c_attn", "c_proj", "attn_dropout", "resid_dropout"))
                and has_children(mlp, ("c_fc", "gelu", "c_proj", "dropout"))
                and all(isinstance(m, nn.Linear) for m in (attn.c_attn, attn.c_proj,
                                                           mlp.c_fc, mlp.c_proj))
                and isinstance(getattr(attn, "n_head", None), int)
                and isinstance(mlp.gelu, nn.GELU)):
            return None
        linears = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
        if any(m.bias is None for m in linears) or \
                any(getattr(n, "bias", None) is None for n in (layer.ln_1, layer.ln_2)):
            return "bias=False: a LayerNorm without bias has no fusible op yet"
        eps = {norm_eps(layer.ln_1), norm_eps(layer.ln_2)} - {None} or {_DEFAULT_EPS}
        if len(eps) != 1:
            return "its norms' epsilons differ"
        hidden, heads = attn.c_proj.out_features, attn.n_head
        activation = "gelu_tanh" if mlp.gelu.approximate == "tanh" else "gelu"
        return dict(hidden_size=hidden, ffn_hidden_size=mlp.c_fc.out_features,
                    num_heads=heads, head_dim=hidden // heads, norm="layernorm",
                    activation=activation, eps=eps.pop(), bias=True, rotary_base=None)

    def parameters(self, layer: Any, spec: dict) -> dict:
        attn, mlp = layer.attn, layer.mlp
        return {"input_norm.weight": layer.ln_1.weight, "input_norm.bias": layer.ln_1.bias,
                "mlp_norm.weight": layer.ln_2.weight, "mlp_norm.bias": layer.ln_2.bias,
                "qkv.weight": attn.c_attn.weight, "qkv.bias": attn.c_attn.bias,
                "proj.weight": attn.c_proj.weight, "proj.bias": attn.c_proj.bias,
                "fc1.weight": mlp.c_fc.weight, "fc1.bias": mlp.c_fc.bias,
                "fc2.weight": mlp.c_proj.weight, "fc2.bias": mlp.c_proj.bias}
