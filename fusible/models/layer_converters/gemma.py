"""Gemma decoder layers: Llama's, with norms that scale by ``1 + weight`` and a GELU(tanh)
gated MLP; Gemma 2 adds a norm after each branch (TransformerLayer's ``"sandwich"``
residual; HF's ``post_attention_layernorm`` is then the attention branch's, and
``pre_feedforward_layernorm`` the MLP's input norm) and soft-caps the attention's logits
(``ops.Attention(softcap=...)``: fused on the CPU; on CUDA no kernel is chosen for it
unasked, so the probe refuses the layer there). Gemma 3's q/k norms scale by
``1 + weight`` too (the attention's ``qk_norm_zero_centered``), and each layer takes its
layer type's rotary tables from the model (``rotary_tables``)."""

from __future__ import annotations

from typing import Any, Union

from fusible.models.layer_converters.llama import LlamaLayers, shaped_like_llama

_SANDWICH = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm",
             "pre_feedforward_layernorm", "post_feedforward_layernorm"}


class GemmaLayers(LlamaLayers):
    name = "gemma"

    def recognise(self, layer: Any) -> Union[None, str, dict]:
        sandwich = set(layer._modules) == _SANDWICH
        if sandwich and not shaped_like_llama(_LlamaView(layer)):
            return None
        # a Llama-shaped layer is asked here after the Llama reading's probe refused it:
        # with norms scaling by 1 + weight and a GELU(tanh) MLP, the probe decides again
        spec = super().recognise(layer) if not sandwich else self._sandwich_spec(layer)
        if not isinstance(spec, dict):
            return spec
        softcap = getattr(getattr(layer.self_attn, "config", None), "attn_logit_softcapping",
                          None)
        if softcap:  # Gemma 2's default (on CUDA the probe refuses it: flex only if asked)
            spec.update(softcap=float(softcap))
        if hasattr(layer.self_attn, "q_norm"):  # Gemma 3's, scaling by 1 + weight too
            spec.update(qk_norm_zero_centered=True)
        spec.update(zero_centered_gamma=True, activation="geglu",
                    residual="sandwich" if sandwich else "pre_norm")
        return spec

    def _sandwich_spec(self, layer: Any) -> Union[None, str, dict]:
        """The Llama reading of a Gemma 2 layer: its four norms' epsilon alike."""
        eps = {getattr(getattr(layer, n), "eps", None) for n in _SANDWICH - {"self_attn", "mlp"}}
        if len(eps) != 1:
            return "its norms' epsilons differ or cannot be read"
        return super().recognise(_LlamaView(layer))

    def parameters(self, layer: Any, spec: dict) -> dict:
        if spec["residual"] != "sandwich":
            return super().parameters(layer, spec)
        params = super().parameters(_LlamaView(layer), spec)
        params.update({"mlp_norm.weight": layer.pre_feedforward_layernorm.weight,
                       "post_attention_norm.weight": layer.post_attention_layernorm.weight,
                       "post_mlp_norm.weight": layer.post_feedforward_layernorm.weight})
        return params


class _LlamaView:
    """A Gemma 2 layer as the Llama reading sees it: ``post_attention_layernorm`` is the
    MLP's input norm there (``pre_feedforward_layernorm`` here)."""

    def __init__(self, layer: Any):
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.pre_feedforward_layernorm
        self._modules = {"self_attn": 0, "mlp": 0, "input_layernorm": 0,
                         "post_attention_layernorm": 0}

