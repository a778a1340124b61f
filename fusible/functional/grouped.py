"""Grouped GEMMs: one weight per group (expert), the tokens of each group consecutive, the
groups' sizes given as a tensor (``splits``), empty groups included.

On Hopper GPUs (bf16, sizes multiple of 8) ``torch._grouped_mm``; on other GPUs and
dtypes Triton grouped GEMMs (``fusible.kernels.grouped_gemm``); both read the sizes on
the device (no host synchronisation, so CUDA graphs and changing routings work). On the
CPU one GEMM per group, which reads them on the host.
"""

from __future__ import annotations

import torch

from fusible.kernels import grouped_gemm, triton_can_run

Tensor = torch.Tensor


def grouped_mm_available(t: Tensor, *features: int) -> bool:
    """Whether ``torch._grouped_mm`` takes operands like ``t`` with these feature sizes:
    plain bf16 tensors on a Hopper GPU (compute capability 9.x: on Blackwell its weight
    gradient of an empty group is not zero, pytorch#172439), sizes multiple of 8 (16-byte
    rows)."""
    if not (t.is_cuda and hasattr(torch, "_grouped_mm") and t.dtype == torch.bfloat16
            and type(t) is torch.Tensor) or any(f % 8 for f in features):
        return False
    return torch.cuda.get_device_capability(t.device)[0] == 9


def _ranges(splits: Tensor) -> list:
    """``(start, stop)`` of each group's tokens (reads the sizes on the host)."""
    out, start = [], 0
    for size in splits.tolist():
        out.append((start, start + size))
        start += size
    return out


def check_splits(splits: Tensor, tokens: int, where: str) -> None:
    """Asynchronously (on the device, no host synchronisation) that the split sizes are
    non-negative and add up to ``tokens``."""
    torch._assert_async((splits >= 0).all() & (splits.sum() == tokens),
                        f"{where}: the split sizes must be non-negative and add up to the "
                        f"{tokens} tokens of the input")


def grouped_forward(x: Tensor, weight: Tensor, splits: Tensor) -> Tensor:
    """``y[group g's tokens] = x[those tokens] @ weight[g].T``; ``x`` (tokens, in)."""
    if weight.dtype == x.dtype and grouped_mm_available(x, *weight.shape[-2:]):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=grouped_gemm.group_ends(splits))
    if weight.dtype == x.dtype and triton_can_run(x, weight):
        return grouped_gemm.grouped_mm_triton(x, weight, splits)
    y = x.new_empty((x.shape[0], weight.shape[-2]))
    for g, (lo, hi) in enumerate(_ranges(splits)):
        torch.mm(x[lo:hi], weight[g].t(), out=y[lo:hi])
    return y


def grouped_dgrad(dy: Tensor, weight: Tensor, splits: Tensor) -> Tensor:
    """``dx[group g's tokens] = dy[those tokens] @ weight[g]``: the forward's grouped GEMM
    with each group's weight transposed (a view: the same kernels)."""
    return grouped_forward(dy, weight.transpose(-2, -1), splits)


def grouped_wgrad(dy: Tensor, x: Tensor, splits: Tensor, num_groups: int) -> Tensor:
    """``dweight[g] = dy[group g's tokens].T @ x[those tokens]`` (zeros for an empty
    group), shape (groups, out, in)."""
    if x.dtype == dy.dtype and grouped_mm_available(x, dy.shape[-1], x.shape[-1]):
        return torch._grouped_mm(dy.t(), x, offs=grouped_gemm.group_ends(splits))
    if x.dtype == dy.dtype and triton_can_run(dy, x):
        return grouped_gemm.grouped_wgrad_triton(dy, x, splits, num_groups)
    dw = dy.new_empty((num_groups, dy.shape[-1], x.shape[-1]))
    for g, (lo, hi) in enumerate(_ranges(splits)):
        torch.mm(dy[lo:hi].t(), x[lo:hi], out=dw[g])
    return dw


def bias_per_token(bias: Tensor, splits: Tensor, tokens: int) -> Tensor:
    """Each token's row of ``bias`` (groups, out): its group's."""
    return bias.repeat_interleave(splits, dim=0, output_size=tokens)


def grouped_bias_grad(dy: Tensor, splits: Tensor) -> Tensor:
    """``dbias[g] = dy[group g's tokens].sum(0)`` (zeros for an empty group), summed in
    float32 for 16-bit ``dy``, without atomics (deterministic) or host synchronisation."""
    acc = _accumulation_dtype(dy)
    # unsafe: no host-side check of the lengths (check_splits checks them on the device)
    return torch.segment_reduce(dy.to(acc), "sum", lengths=splits, axis=0,
                                unsafe=True).to(dy.dtype)


def _accumulation_dtype(t: Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def add_scaled_bias(y: Tensor, bias: Tensor, scales: Tensor, splits: Tensor) -> Tensor:
    """``y[i] + scales[i] * bias[group of token i]``, computed in float32 for 16-bit
    tensors and rounded once (a mixture of experts' routing probabilities scaling each
    expert's bias, as TransformerEngine's ``GroupedLinear(scale_bias=True)``)."""
    acc = _accumulation_dtype(y)
    rows = bias_per_token(bias, splits, y.shape[0]).to(acc)
    return (y.to(acc) + scales.reshape(-1, 1).to(acc) * rows).to(y.dtype)


def scaled_bias_grads(dy: Tensor, bias: Tensor, scales: Tensor, splits: Tensor,
                      need_bias: bool, need_scales: bool) -> tuple:
    """``(dbias, dscales)`` of :func:`add_scaled_bias` (None where not needed):
    ``dbias[g] = sum over group g's tokens of dy[i] * scales[i]`` and ``dscales[i] =
    dy[i] . bias[group of i]``, summed in float32 for 16-bit tensors."""
    acc = _accumulation_dtype(dy)
    dy_acc, s_acc = dy.to(acc), scales.reshape(-1, 1).to(acc)
    dbias = dscales = None
    if need_bias:
        dbias = torch.segment_reduce(dy_acc * s_acc, "sum", lengths=splits, axis=0,
                                     unsafe=True).to(bias.dtype)
    if need_scales:
        rows = bias_per_token(bias, splits, dy.shape[0]).to(acc)
        dscales = (dy_acc * rows).sum(-1).to(scales.dtype).reshape(scales.shape)
    return dbias, dscales
