"""CausalLM: a decoder-only language model made of TransformerLayers, its loss from the
chunked LM head (the logits never stored), as Hugging Face's ``LlamaForCausalLM`` computes
it."""

from __future__ import annotations

import collections
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from fusible import ops
from fusible.core import checks
from fusible.core.arg_types import DTypeArg, DeviceArg
from fusible.layers.hf_names import llama_layer_state_dict
from fusible.layers.transformer_layer import TransformerLayer


class CausalLM(nn.Module):
    """Token embedding, ``num_layers`` pre-norm :class:`TransformerLayer`\\ s, a final
    RMSNorm, and the LM head with its cross-entropy (``ops.LinearCrossEntropy``):
    ``loss = model(input_ids, labels)``.

    The loss is Hugging Face's causal-LM loss: each position predicts the next token
    (``labels`` shifted left by one inside, the last position ignored), the mean over the
    tokens whose label is not ``ignore_index`` (-100).

    Parameters
    ----------
    vocab_size, hidden_size, ffn_hidden_size, num_layers, num_heads : int
    num_kv_heads : int, optional
        Grouped-query attention's key/value heads.
    rotary_base : float
    eps : float
        The norms' epsilon.
    tie_embeddings : bool
        The head's weight is the embedding's (Llama 3.2 1B/3B).
    device, dtype
        Of the parameters.
    **layer_options
        Passed to every :class:`TransformerLayer` (``rotary_scaling``, ``head_dim``, ...).

    Attributes
    ----------
    embed : nn.Embedding
    layers : nn.ModuleList of TransformerLayer
    head : ops.Sequential
        ``norm`` (RMSNorm) then ``lm_head`` (LinearCrossEntropy): one plan.
    """

    def __init__(self, vocab_size: int, hidden_size: int, ffn_hidden_size: int,
                 num_layers: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 rotary_base: float = 10000.0, eps: float = 1e-5,
                 tie_embeddings: bool = False, device: DeviceArg = None,
                 dtype: DTypeArg = None, **layer_options):
        super().__init__()
        checks.positive_int("num_layers")("CausalLM", num_layers)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed = nn.Embedding(vocab_size, hidden_size, **factory)
        self.layers = nn.ModuleList(
            TransformerLayer(hidden_size, ffn_hidden_size, num_heads, num_kv_heads=num_kv_heads,
                             rotary_base=rotary_base, eps=eps, **layer_options, **factory)
            for _ in range(num_layers))
        norm = ops.RMSNorm(hidden_size, eps=eps, **factory)
        lm_head = ops.LinearCrossEntropy(hidden_size, vocab_size, **factory)
        if tie_embeddings:
            lm_head.weight = cast(nn.Parameter, self.embed.weight)
        self.head = ops.Sequential(collections.OrderedDict(  # type: ignore[arg-type]
            norm=norm, lm_head=lm_head))
        self.tie_embeddings = tie_embeddings

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of ``input_ids`` ``(batch, seq)`` against ``labels``
        (the same shape; -100 where nothing is predicted)."""
        return self.head(self.hidden_states(input_ids), shift_labels(labels))

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The last layer's output, before the final norm."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The whole logits ``(batch, seq, vocab)`` (for generation or evaluation: made
        whole, unlike the loss's)."""
        norm = cast(ops.RMSNorm, self.head.norm)
        lm_head = cast(ops.LinearCrossEntropy, self.head.lm_head)
        return F.linear(norm(self.hidden_states(input_ids)), lm_head.weight)

    @staticmethod
    def state_dict_from_llama(hf_state: dict) -> dict:
        """A Hugging Face ``LlamaForCausalLM`` (Mistral, Qwen2, Qwen3) state dict in this
        model's names (the layers' by :func:`llama_layer_state_dict`)."""
        out: dict = {}
        layers: dict = {}
        for key, value in hf_state.items():
            if key.startswith("model.layers."):
                index, rest = key[len("model.layers."):].split(".", 1)
                layers.setdefault(int(index), {})[rest] = value
            else:
                renamed = {"model.embed_tokens.weight": "embed.weight",
                           "model.norm.weight": "head.norm.weight",
                           "lm_head.weight": "head.lm_head.weight"}.get(key)
                if renamed is None:
                    raise KeyError(f"CausalLM.state_dict_from_llama: no place for {key!r}")
                out[renamed] = value
        for index, layer in sorted(layers.items()):
            out.update({f"layers.{index}.{k}": v
                        for k, v in llama_layer_state_dict(layer).items()})
        return out


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Each position's label is the next token's (Hugging Face's causal-LM loss); the
    last position has none."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
