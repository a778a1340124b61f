"""Tile shapes of the high-precision kernels beside a decoder layer's GEMMs, at the 1B
layer's shapes (8192 tokens, hidden 2048, FFN 8192, 32 heads of 64, 8 kv heads) and the
debugmodel's (16384 tokens, hidden 256, FFN 768, 16 + 16 heads of 16): SwiGLU forward, its
recomputing backward (the output written again over the dgrad, the input gradient over
the input), the norm backward's whole-row kernel and the QKV rotary kernel, each with the
bytes it must move and the rate it reached (the H100's copy rate is about 3 TB/s, the
H200's 4.2). The profile of the 1B layer had them at 55-70% of it.

    PYTHONPATH=. python3 benchmarks/diagnostics/bf16_kernel_tiles.py [swiglu] [norm] [rotary]
"""

import itertools
import sys

import torch
import triton.testing

from fusible.kernels import norms, rotary
from fusible.kernels.swiglu import swiglu_backward_triton, swiglu_forward_triton

BF16 = torch.bfloat16


def report(name: str, fn, gigabytes: float, graphed: bool = False) -> None:
    """``graphed``: timed as CUDA-graph replays (a small kernel's launches would
    otherwise time the host)."""
    if graphed:
        ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    else:
        ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    print(f"{name:<64} {ms * 1e3:8.1f} us  {gigabytes / ms:6.2f} TB/s", flush=True)


def swiglu(tokens: int, ffn: int) -> None:
    x = torch.randn(tokens, 2 * ffn, device="cuda", dtype=BF16)
    dy = torch.randn(tokens, ffn, device="cuda", dtype=BF16)
    gb = dy.numel() * 2 / 1e9  # one bf16 tensor of the output's size, in GB
    for (bm, bn), warps in itertools.product(((32, 128), (64, 128), (16, 256), (32, 256),
                                              (8, 512), (64, 64)), (4, 8)):
        report(f"swiglu fwd {tokens}x{ffn}, tile {bm}x{bn}, {warps} warps",
               lambda: swiglu_forward_triton(x, bm, bn, num_warps=warps), 2 * gb + gb)
        # reads dy and x, writes dx over x and y over dy (the recomputing backward)
        grad, read = dy.clone(), x.clone()
        report(f"swiglu bwd+y {tokens}x{ffn}, tile {bm}x{bn}, {warps} warps",
               lambda: swiglu_backward_triton(grad, read, bm, bn, with_output=True,
                                              consume_grad=True, consume_input=True,
                                              num_warps=warps), 3 * gb + 3 * gb)


def norm_backward(tokens: int, hidden: int) -> None:
    x, dy, add = (torch.randn(tokens, hidden, device="cuda", dtype=BF16) for _ in range(3))
    w = torch.randn(hidden, device="cuda", dtype=BF16)
    _, _, rstd = norms.norm_forward_triton(x, w, None, 1e-5, False)
    gb = x.numel() * 2 / 1e9
    defaults = norms._ROW_TILE, norms._PROGRAMS_PER_SM, norms._ROW_WARPS
    for tile, per_sm, warps in itertools.product((1024, 2048, 4096), (4, 8, 16), (None, 8)):
        norms._ROW_TILE, norms._PROGRAMS_PER_SM, norms._ROW_WARPS = tile, per_sm, warps
        report(f"norm bwd {tokens}x{hidden}, row tile {tile}, {per_sm} programs/SM, "
               f"{warps or 'default'} warps",
               lambda: norms.norm_backward_triton(dy, x, None, rstd, w, False, True, True,
                                                  accumulate_into=add), 4 * gb, graphed=True)
    norms._ROW_TILE, norms._PROGRAMS_PER_SM, norms._ROW_WARPS = defaults


def qkv_rotary(tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=BF16)
    angles = torch.rand(tokens, head_dim // 2, device="cuda") * 6
    cos, sin = angles.cos(), angles.sin()
    gb = qkv.numel() * 2 / 1e9
    q, k, v = torch.split(torch.randn_like(qkv), [heads * head_dim, kv_heads * head_dim,
                                                  kv_heads * head_dim], dim=1)
    grads = [t.contiguous().view(tokens, -1, head_dim) for t in (q, k, v)]
    for group, block_t in itertools.product((None, 1), (None, 8, 16, 32, 64)):
        what = (f"{tokens} tokens, {heads}+{kv_heads} heads of {head_dim}, "
                f"{group or 'default'} heads x {block_t or 'default'} tokens/program")
        report(f"qkv rotary fwd {what}",
               lambda: rotary.qkv_rotary_forward_triton(qkv, cos, sin, heads, kv_heads, False,
                                                        block_t=block_t, group=group), 2 * gb)
        report(f"qkv rotary bwd {what}",
               lambda: rotary.qkv_rotary_backward_triton(*grads, cos, sin, False,
                                                         block_t=block_t, group=group), 2 * gb)


def main(parts: list) -> None:
    print(torch.cuda.get_device_name())
    if "swiglu" in parts:
        swiglu(8192, 8192)
        swiglu(16384, 768)
    if "norm" in parts:
        norm_backward(8192, 2048)
        norm_backward(16384, 256)
    if "rotary" in parts:
        qkv_rotary(8192, 32, 8, 64)
        qkv_rotary(16384, 16, 16, 16)
        qkv_rotary(8192, 32, 8, 128)


if __name__ == "__main__":
    main(sys.argv[1:] or ["swiglu", "norm", "rotary"])
