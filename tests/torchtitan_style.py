"""A torchtitan-style Llama (the layout and calls of ``torchtitan/models/llama3``, written
here: torchtitan is no test dependency): ``nn.RMSNorm``, ``wq``/``wk``/``wv``/``wo``,
``w1``/``w2``/``w3``, interleaved rotary pairs through a complex ``freqs_cis`` table the
root holds and passes to every block, layers in a ``ModuleDict``."""

import math

import torch
import torch.nn.functional as F
from torch import nn


def freqs_cis_table(head_dim: int, length: int, theta: float, scaling=None) -> torch.Tensor:
    """``exp(i * t * f_k)`` for positions ``t < length`` (complex64), ``f_k`` Llama 3.1
    rescaled where ``scaling`` = (factor, low, high, original length)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    if scaling is not None:
        factor, low, high, original = scaling
        wavelen = 2 * math.pi / freqs
        smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
        freqs = torch.where(wavelen > original / low, freqs / factor,
                            (1 - smooth) * freqs / factor + smooth * freqs)
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor, positions=None) -> torch.Tensor:
    """Pairs ``(x[2i], x[2i+1])`` of ``x`` (B, S, heads, D) as complex numbers times the
    table's first S rows (its rows at ``positions`` (B, S) when given), in float32."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    if positions is None:
        table = freqs_cis[:x.shape[1]].view(1, x.shape[1], 1, -1)
    else:
        table = freqs_cis[positions].unsqueeze(2)
    return torch.view_as_real(pairs * table).flatten(3).type_as(x)


class SDPA(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, qk_norm=False, eps=1e-5):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        norm = (lambda: nn.RMSNorm(self.head_dim, eps=eps)) if qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()
        self.attn_type = "sdpa"
        self.inner_attention = SDPA()

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        assert attention_masks is None
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q = rotate(self.q_norm(q), freqs_cis, positions)
        k = rotate(self.k_norm(k), freqs_cis, positions)
        groups = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, hidden, n_heads, n_kv_heads, eps=1e-5, qk_norm=False):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads, qk_norm, eps)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, x, freqs_cis, attention_masks=None, positions=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab=96, dim=32, hidden=48, n_layers=2, n_heads=4, n_kv_heads=2,
                 theta=500000.0, max_seq=64, scaling=(8.0, 1.0, 4.0, 16), qk_norm=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, hidden, n_heads,
                                                              n_kv_heads, qk_norm=qk_norm)
                                     for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis",
                             freqs_cis_table(dim // n_heads, max_seq, theta, scaling),
                             persistent=False)

    def forward(self, tokens, attention_masks=None, positions=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks, positions)
        return self.output(self.norm(h))
