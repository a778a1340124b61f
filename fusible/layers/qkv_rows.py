"""A fused QKV projection's rows rank by rank, for attention heads split over a
tensor-parallel group: a column-parallel layer gives rank ``r`` a contiguous block of
rows, which must hold that rank's q heads, then its k heads, then its v heads."""

from __future__ import annotations

import torch


def _parts(t: torch.Tensor, num_heads: int, num_kv_heads: int, world_size: int,
           where: str) -> list:
    slots = num_heads + 2 * num_kv_heads
    if t.dim() == 0 or t.shape[0] % slots or num_heads % world_size or \
            num_kv_heads % world_size:
        raise ValueError(f"{where}: needs rows (num_heads + 2 * num_kv_heads) x head_dim = "
                         f"{slots} x head_dim and heads dividing by world_size {world_size}, "
                         f"got {tuple(t.shape)} rows for num_heads {num_heads}, "
                         f"num_kv_heads {num_kv_heads}")
    return [num_heads * t.shape[0] // slots, num_kv_heads * t.shape[0] // slots]


def qkv_rows_by_rank(t: torch.Tensor, num_heads: int, num_kv_heads: int,
                     world_size: int) -> torch.Tensor:
    """A QKV weight or bias with rows ``[q heads | k heads | v heads]`` (Hugging Face's
    projections stacked, :class:`TransformerLayer`'s ``qkv``) reordered rank by rank:
    ``[q, k, v of rank 0's heads | q, k, v of rank 1's | ...]``, so that each rank's
    column-parallel shard is what ``ops.Attention(tensor_parallel=True)`` reads.

    Raises ValueError for rows or head counts that do not divide.
    """
    q_rows, kv_rows = _parts(t, num_heads, num_kv_heads, world_size, "qkv_rows_by_rank")
    parts = [p.chunk(world_size) for p in t.split([q_rows, kv_rows, kv_rows])]
    return torch.cat([torch.cat(rank) for rank in zip(*parts)])


def qkv_rows_by_kind(t: torch.Tensor, num_heads: int, num_kv_heads: int,
                     world_size: int) -> torch.Tensor:
    """The inverse of :func:`qkv_rows_by_rank`: rows ``[q heads | k heads | v heads]``
    again (to save a checkpoint in the unsplit layout)."""
    q_rows, kv_rows = _parts(t, num_heads, num_kv_heads, world_size, "qkv_rows_by_kind")
    ranks = [r.split([q_rows // world_size, kv_rows // world_size, kv_rows // world_size])
             for r in t.chunk(world_size)]
    return torch.cat([torch.cat(kind) for kind in zip(*ranks)])
