"""torchtitan-style Llama blocks (``torchtitan/models/llama3``'s ``TransformerBlock``):
``attention_norm`` and ``ffn_norm`` (``nn.RMSNorm``), ``attention`` (``wq``, ``wk``,
``wv``, ``wo``, optional ``q_norm`` / ``k_norm``, an SDPA wrapper; ``n_heads``,
``n_kv_heads``, ``head_dim``), ``feed_forward`` (``w2(silu(w1(x)) * w3(x))``), called
``block(x, freqs_cis, attention_masks, positions=None)``: the rotary embedding rotates
interleaved pairs by the model's own complex table ``freqs_cis``, which the fused layer
takes as its rotary tables (so any frequency scheme the model computes holds)."""

from __future__ import annotations

import math
from typing import Any, Union

import torch
from torch import nn

from fusible.models.call_arguments import takes
from fusible.models.layer_converter import (LayerConverter, has_children,
                                            separate_projections, shared_eps)

_ATTENTION = ("wq", "wk", "wv", "wo")
_FEED_FORWARD = ("w1", "w2", "w3")


class TorchTitanLayers(LayerConverter):
    name = "torchtitan"
    cache_kwargs = ()
    mask_kwargs = ("attention_masks",)  # flex / varlen masks: the original forward
    taken_kwargs = frozenset({"freqs_cis", "attention_masks"})

    def recognise(self, layer: Any) -> Union[None, str, dict]:
        if not shaped_like_torchtitan(layer):
            return None
        attn, ff = layer.attention, layer.feed_forward
        kind = getattr(attn, "attn_type", "sdpa")
        if kind != "sdpa":
            return (f"its attention is attn_type {kind!r}, whose masks the fused layer does "
                    f"not take (fused: 'sdpa')")
        ff_bias = {getattr(ff, n).bias is not None for n in _FEED_FORWARD}
        qkv_bias = {getattr(attn, n).bias is not None for n in _ATTENTION[:3]}
        if len(ff_bias) > 1 or len(qkv_bias) > 1 or ff_bias != {attn.wo.bias is not None}:
            return (f"its biases are not one setting for q/k/v and one for wo and the "
                    f"feed-forward (q/k/v {sorted(qkv_bias)}, feed-forward {sorted(ff_bias)}, "
                    f"wo {attn.wo.bias is not None})")
        eps = shared_eps(layer.attention_norm, layer.ffn_norm)
        if isinstance(eps, str):
            return eps
        spec: dict[str, Any] = dict(
            hidden_size=attn.wq.in_features, ffn_hidden_size=ff.w1.out_features,
            num_heads=attn.n_heads, num_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim,
            eps=eps, bias=attn.wo.bias is not None, qkv_bias=qkv_bias.pop(),
            rotary_base=None, rotary_tables=True, rotary_interleaved=True)
        q_norm = getattr(attn, "q_norm", None)
        if isinstance(q_norm, nn.RMSNorm):
            qk_eps = shared_eps(q_norm, attn.k_norm)
            if isinstance(qk_eps, str):
                return "its q/k norms' epsilons differ or cannot be read"
            spec.update(qk_norm=True, qk_norm_eps=qk_eps)
        return spec

    def joined_groups(self, layer: Any) -> tuple:
        attn, ff = layer.attention, layer.feed_forward
        return (attn.wq, attn.wk, attn.wv), (ff.w1, ff.w3)

    def parameters(self, layer: Any, spec: dict) -> dict:
        attn, ff = layer.attention, layer.feed_forward
        return separate_projections(spec, layer.attention_norm, layer.ffn_norm,
                                    (attn.wq, attn.wk, attn.wv), attn.wo, (ff.w1, ff.w3), ff.w2,
                                    (attn.q_norm, attn.k_norm))

    def fused_inputs(self, spec: dict, hidden_states: torch.Tensor, named: dict) -> tuple:
        """``(cos, sin)`` of the first ``S`` rows of the call's ``freqs_cis``, as the
        block's ``reshape_for_broadcast`` slices it."""
        freqs = named.get("freqs_cis")
        if not isinstance(freqs, torch.Tensor) or not freqs.is_complex():
            raise TypeError(f"a torchtitan block takes freqs_cis, a complex tensor (max_seq, "
                            f"head_dim / 2); got {type(freqs).__name__}")
        pairs = torch.view_as_real(freqs[:hidden_states.shape[1]])
        return pairs[..., 0], pairs[..., 1]

    def probe_kwargs(self, layer: Any, spec: dict, x: torch.Tensor,
                     positions: torch.Tensor) -> dict:
        """A table of random angles (not the model's frequencies, which the block does not
        hold): the probe checks the rotation, whatever the table."""
        generator = torch.Generator(x.device).manual_seed(1)
        angles = (torch.rand(positions.shape[0], spec["head_dim"] // 2, generator=generator,
                             device=x.device) * 2 - 1) * math.pi
        return {"freqs_cis": torch.polar(torch.ones_like(angles), angles),
                "attention_masks": None}


def shaped_like_torchtitan(layer: Any) -> bool:
    """The children of a torchtitan-style block and nothing else, called with
    ``freqs_cis`` (torchtitan's Qwen3 blocks, alike otherwise, take a ``rope_cache``)."""
    attn: Any = getattr(layer, "attention", None)
    ff: Any = getattr(layer, "feed_forward", None)
    return (takes(layer, "freqs_cis")
            and has_children(layer, ("attention", "feed_forward", "attention_norm", "ffn_norm"))
            and has_children(attn, _ATTENTION, ("q_norm", "k_norm", "inner_attention"))
            and has_children(ff, _FEED_FORWARD)
            and all(isinstance(getattr(attn, n), nn.Linear) for n in _ATTENTION)
            and all(isinstance(getattr(ff, n), nn.Linear) for n in _FEED_FORWARD)
            and all(isinstance(getattr(attn, n, None), int)
                    for n in ("n_heads", "n_kv_heads", "head_dim"))
            and all(isinstance(getattr(getattr(layer, n), "weight", None), nn.Parameter)
                    for n in ("attention_norm", "ffn_norm")))
