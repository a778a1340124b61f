"""Whole models as users write them, for the model-level tests: a GPT with plain-PyTorch
attention and fusible LayerNorm / Linear / GELU / residual Sequentials."""

from __future__ import annotations

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


# Plain PyTorch, as users write them, for fusible.convert ----------------------------

class TorchGPTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attend = Attend(heads)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * hidden, hidden), nn.Dropout(0.0))

    def forward(self, x):
        x = x + self.proj(self.attend(self.qkv(self.ln_1(x))))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=2, layers=2, head_bias=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.h = nn.ModuleList(TorchGPTBlock(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=head_bias)

    def forward(self, tokens):
        x = self.wte(tokens)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h))


class LlamaLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.self_attn = LlamaAttention(hidden, heads)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.mlp = LlamaMLP(hidden, ffn)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TorchLlama(nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=2, ffn=64, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaLayer(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))
