"""Token routing for mixtures of experts, around :class:`fusible.ops.GroupedLinear`.

A layer routes each token to ``k`` experts (:func:`route_top_k`), sorts the token copies
by expert (:func:`permute_tokens`, which also gives each expert's token count, the
``splits`` GroupedLinear takes), runs the experts on the sorted copies, and combines each
token's ``k`` results weighted by the router (:func:`unpermute_tokens`). Plain PyTorch,
differentiable, deterministic (every gather reads distinct rows, so no gradient is summed
by atomics), and traceable: the counts stay on the device, so a compiled layer does not
recompile when the routing changes.
Dropless: every token reaches its ``k`` experts.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

Tensor = torch.Tensor


class Routing(NamedTuple):
    """Where each token's copies went (a named tuple: dynamo traces it).

    Attributes
    ----------
    order : Tensor
        (tokens * k,) int64: for each row of the sorted copies, its row in the token-major
        list of copies (token ``t``'s ``j``-th copy is row ``t * k + j``).
    splits : Tensor
        (num_experts,) int64: how many copies each expert got, in expert order.
    k : int
        Experts per token.
    """

    order: Tensor
    splits: Tensor
    k: int


def route_top_k(logits: Tensor, k: int, *, normalize: bool = True) -> tuple:
    """``(experts, weights)``, each (tokens, k): each token's ``k`` highest-scoring experts
    and their softmax probabilities (renormalised over the ``k`` when ``normalize``, as
    Mixtral does; DeepSeek-V3 and Qwen3 likewise).

    Raises ValueError unless ``0 < k <= num_experts``.
    """
    num_experts = logits.shape[-1]
    if not 0 < k <= num_experts:
        raise ValueError(f"route_top_k: k must be in 1..{num_experts} (the experts), got {k}")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights.to(logits.dtype)


def permute_tokens(x: Tensor, experts: Tensor, num_experts: int) -> tuple:
    """``(sorted copies, Routing)``: each token of ``x`` (tokens, features) copied once per
    expert in ``experts`` (tokens, k), the copies sorted by expert (stably: tokens in order
    within an expert)."""
    if experts.dim() != 2 or experts.shape[0] != x.shape[0]:
        raise ValueError(f"permute_tokens: experts must be (tokens, k) = ({x.shape[0]}, k), got "
                         f"{tuple(experts.shape)}")
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    torch._assert_async(((flat >= 0) & (flat < num_experts)).all(),
                        f"permute_tokens: expert indices must be in 0..{num_experts - 1}")
    order = torch.argsort(flat, stable=True)
    splits = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    splits.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    # k copies of each token (their gradients summed by a reshape, not by atomics), sorted
    copies = x.unsqueeze(1).expand(tokens, k, x.shape[-1]).reshape(tokens * k, x.shape[-1])
    return copies[order], Routing(order, splits, k)


def unpermute_tokens(y: Tensor, routing: Routing, weights: Optional[Tensor] = None) -> Tensor:
    """``out[t] = sum_j weights[t, j] * y[copy j of token t]``: the experts' outputs
    ``y`` (in the sorted order of :func:`permute_tokens`) back in token order, combined by
    the router's ``weights`` (tokens, k), or summed where the experts applied them already
    (None: a scaled gated unit, :func:`sorted_weights`). Differentiable in ``y`` and
    ``weights``."""
    inverse = torch.empty_like(routing.order)
    inverse[routing.order] = torch.arange(routing.order.numel(), device=y.device)
    copies = y[inverse].view(-1, routing.k, y.shape[-1])  # token-major
    if weights is None:
        return copies.sum(1)
    return (copies * weights.unsqueeze(-1).to(y.dtype)).sum(1)


def sorted_weights(weights: Tensor, routing: Routing) -> Tensor:
    """The router's ``weights`` (tokens, k) in the sorted order of the copies: the scales
    a scaled gated unit (``ops.ScaledSwiGLU`` ...) takes inside the experts."""
    return weights.reshape(-1)[routing.order]
