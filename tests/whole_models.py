"""Whole models as users write them, for the model-level tests: a GPT with plain-PyTorch
attention and fusible LayerNorm / Linear / GELU / residual Sequentials."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusible import ops


class Attend(nn.Module):
    """Causal scaled-dot-product attention of a packed ``qkv`` (plain PyTorch)."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, qkv):
        b, s, three_h = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, three_h // 3)


class FusibleGPTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.qkv = ops.Sequential(ops.LayerNorm(hidden), ops.Linear(hidden, 3 * hidden))
        self.attend = Attend(heads)
        self.proj = ops.Sequential(ops.Linear(hidden, hidden), ops.AddExtraInput())
        self.mlp = ops.Sequential(ops.LayerNorm(hidden), ops.Linear(hidden, 4 * hidden),
                                  ops.GELU(approximate="tanh"), ops.Linear(4 * hidden, hidden),
                                  ops.AddExtraInput())

    def forward(self, x):
        x = self.proj(self.attend(self.qkv(x)), x)  # x + proj(attention)
        return self.mlp(x, x)  # x + mlp(x)


class FusibleGPT(nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(FusibleGPTBlock(hidden, heads) for _ in range(layers))
        self.head = ops.Sequential(ops.LayerNorm(hidden), ops.Linear(hidden, vocab))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)
