"""Hugging Face decoder layers' weights in :class:`TransformerLayer`'s names: the query,
key and value projections stacked into ``qkv``, a gated MLP's gate and up projections
into ``fc1``. Works on state dicts (no transformers import)."""

from __future__ import annotations

import torch

# TransformerLayer name <- Hugging Face's (Llama, Mistral, Qwen2, Qwen3) within one layer
_RENAMED = {"input_norm.weight": "input_layernorm.weight",
            "mlp_norm.weight": "post_attention_layernorm.weight",
            "proj.weight": "self_attn.o_proj.weight",
            "fc2.weight": "mlp.down_proj.weight",
            "attention.q_norm_weight": "self_attn.q_norm.weight",
            "attention.k_norm_weight": "self_attn.k_norm.weight"}
_STACKED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "fc1": ("mlp.gate_proj", "mlp.up_proj")}


def llama_layer_state_dict(hf_state: dict) -> dict:
    """A Llama-style Hugging Face decoder layer's state dict (``LlamaDecoderLayer``,
    ``MistralDecoderLayer``, ``Qwen2DecoderLayer``, ``Qwen3DecoderLayer``: keys relative
    to the layer) as a pre-norm, SwiGLU :class:`TransformerLayer`'s.

    Raises KeyError naming the keys it has no place for, or the ones it lacks.
    """
    out: dict = {}
    used: set = set()
    for ours, theirs in _RENAMED.items():
        if theirs in hf_state:
            out[ours], used = hf_state[theirs], used | {theirs}
    for ours, parts in _STACKED.items():
        for kind in ("weight", "bias"):
            keys = [f"{p}.{kind}" for p in parts]
            present = [k in hf_state for k in keys]
            if any(present) and not all(present):
                raise KeyError(f"llama_layer_state_dict: {ours}.{kind} needs all of {keys}, "
                               f"got {[k for k in keys if k in hf_state]}")
            if all(present):
                out[f"{ours}.{kind}"] = torch.cat([hf_state[k] for k in keys])
                used |= set(keys)
    unknown = sorted(set(hf_state) - used)
    if unknown:
        raise KeyError(f"llama_layer_state_dict: no TransformerLayer place for {unknown}")
    return out
