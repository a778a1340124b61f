"""fusible's Triton attention kernels against cuDNN's and FlashAttention-2's, forward and
backward apart, each kernel's tiles swept, at the debugmodel's shape (8 x 2048 tokens, 16
heads of 16), the same width in 8 heads of 32, and the Llama-3.2-1B layer's (2 x 4096, 32
query and 8 kv heads of 64); causal. Each time is the median of CUDA-graph replays, beside
the time the exponent units need for the scores' exponents (one a score forward, one
backward per kernel that recomputes them; 16 a clock per multiprocessor). Before timing,
each tile's results are checked against cuDNN's.

    PYTHONPATH=. python3 benchmarks/diagnostics/attention_tiles.py [--shapes 16,32,64]
        [--defaults-only]
"""

import argparse
import itertools

import torch
import triton.testing

from fusible.functional import attention as attn
from fusible.kernels import attention as kernels

BF16 = torch.bfloat16
SHAPES = {16: (8, 2048, 16, 16), 32: (8, 2048, 8, 8), 64: (2, 4096, 32, 8)}  # B, S, H, K
FORWARD = [(128, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3),
           (128, 64, 8, 3), (256, 64, 8, 3), (128, 64, 4, 2), (64, 32, 4, 3)]
DQ = [(128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3),
      (128, 128, 8, 3)]
DKV = [(64, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3),
       (128, 128, 8, 3), (16, 128, 4, 3)]


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def exponent_floor_us(b: int, s: int, h: int) -> float:
    """The causal scores' exponents at 16 a clock per multiprocessor."""
    props = torch.cuda.get_device_properties(0)
    rate = props.multi_processor_count * 16 * props.clock_rate * 1e3  # clock_rate: kHz
    return b * h * s * (s + 1) / 2 / rate * 1e6


def relative_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def shape_rows(d: int, defaults_only: bool) -> None:
    b, s, h, kv = SHAPES[d]
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, s, kv, d, device="cuda", dtype=BF16) for _ in range(2))
    dout = torch.randn_like(q)
    scale = d ** -0.5
    floor = exponent_floor_us(b, s, h)
    print(f"\n## {b} x {s} tokens, {h} heads ({kv} kv) of {d}: exponents alone "
          f"{floor:.0f} us a pass", flush=True)
    options = {name: attn.AttentionOptions(True, scale, 0, name) for name in ("cudnn", "flash")}
    out, lse, rng = attn.attention_forward(q, k, v, options["cudnn"])
    want = attn.attention_backward(dout, q, k, v, out, lse, rng, options["cudnn"])
    for name, opt in options.items():
        o, l, r = attn.attention_forward(q, k, v, opt)
        print(f"{name:<8} fwd {bench(lambda: attn.attention_forward(q, k, v, opt)):8.1f} us  "
              f"bwd {bench(lambda: attn.attention_backward(dout, q, k, v, o, l, r, opt)):8.1f}"
              f" us", flush=True)
    forward, dq, dkv = FORWARD, DQ, DKV
    if defaults_only:
        forward, dq, dkv = [kernels.FORWARD_TILE], [kernels.DQ_TILE], []
    for tile in forward:
        mine, my_lse = kernels.attention_forward_triton(q, k, v, True, scale, tile)
        err = relative_error(mine, out)
        us = bench(lambda: kernels.attention_forward_triton(q, k, v, True, scale, tile))
        print(f"triton fwd {tile}: {us:8.1f} us  (error against cuDNN {err:.1e})", flush=True)
    for dq_tile, dkv_tile in itertools.chain(((t, kernels.DKV_TILE) for t in dq),
                                             ((kernels.DQ_TILE, t) for t in dkv)):
        grads = kernels.attention_backward_triton(dout, q, k, v, mine, my_lse, True, scale,
                                                  dq_tile, dkv_tile)
        err = max(relative_error(g, w) for g, w in zip(grads, want))
        us = bench(lambda: kernels.attention_backward_triton(dout, q, k, v, mine, my_lse, True,
                                                             scale, dq_tile, dkv_tile))
        print(f"triton bwd dq {dq_tile} dkv {dkv_tile}: {us:8.1f} us  (error {err:.1e})",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16,32,64")
    parser.add_argument("--defaults-only", action="store_true",
                        help="time the kernels' default tiles alone, beside cuDNN and flash")
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    for d in args.shapes.split(","):
        shape_rows(int(d), args.defaults_only)


if __name__ == "__main__":
    main()
