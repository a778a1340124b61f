"""Building blocks made of fusible ops: whole transformer layers, each one
:class:`fusible.ops.Sequential` that the planner fuses as a whole."""

from fusible.layers.causal_lm import CausalLM
from fusible.layers.hf_names import llama_layer_state_dict
from fusible.layers.qkv_rows import qkv_rows_by_kind, qkv_rows_by_rank
from fusible.layers.transformer_layer import TransformerLayer

__all__ = ["CausalLM", "llama_layer_state_dict", "qkv_rows_by_kind", "qkv_rows_by_rank",
           "TransformerLayer"]
