"""Tile sizes of the GELU kernels against the bandwidth the SwiGLU ones reach: each FP8
activation kernel at the zoo's GPT MLP size (16384 x 16384, bf16) over a few tile shapes,
with the bytes each pass must move and the rate it reached (4.2 TB/s is the H200's copy
rate). The zoo's profile had the GELU passes at 35-60% of it, SwiGLU's at 75-90%.
benchmarks/results/activation_tiles_h200.txt is the sweep that chose today's defaults
(whole-tile sums in the backward, 16-row steps, 32x128 cast tiles).

    PYTHONPATH=. python3 benchmarks/diagnostics/activation_tiles.py
"""

import itertools

import torch
import triton.testing

from fusible.kernels.activation_cast import activation_fp8_triton
from fusible.kernels.dact_dbias import dact_dbias_fp8_triton
from fusible.kernels.swiglu import swiglu_backward_fp8_triton, swiglu_forward_fp8_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def report(name: str, fn, gigabytes: float) -> None:
    ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
    print(f"{name:<58} {ms:7.3f} ms  {gigabytes / ms:6.2f} TB/s")


def main(tokens: int = 16384, ffn: int = 16384) -> None:
    x = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    gb = x.numel() * 2 / 1e9  # one bf16 tensor of this size, in GB
    # forward: the amax pass reads x; the cast pass reads x, writes the data and its copy
    for bm, bn in ((32, 128), (16, 128), (32, 256), (16, 256)):
        report(f"gelu_tanh fwd fp8, tile {bm}x{bn}",
               lambda: activation_fp8_triton("gelu_tanh", x, E4M3, 448.0, True, block_m=bm,
                                             block_n=bn), gb + gb + gb)
    # backward: the dbias pass reads dy and x; the cast pass reads both, writes two copies
    for rows, bm, (cm, cn) in itertools.product((256, 128), (16, 8), ((32, 128), (16, 128))):
        report(f"gelu_tanh bwd fp8, {rows} rows/program, {bm}-row steps, cast {cm}x{cn}",
               lambda: dact_dbias_fp8_triton("gelu_tanh", dy, x, E5M2, 57344.0, True,
                                             rows_per_program=rows, block_m=bm,
                                             cast_block_m=cm, cast_block_n=cn),
               2 * gb + 2 * gb + gb)
    swiglu_in = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
    swiglu_dy = torch.randn(tokens, ffn // 2, device="cuda", dtype=torch.bfloat16)
    report("swiglu fwd fp8 (reference)",
           lambda: swiglu_forward_fp8_triton(swiglu_in, E4M3, 448.0, True), gb + gb + gb / 2)
    report("swiglu bwd fp8 (reference)",
           lambda: swiglu_backward_fp8_triton(swiglu_dy, swiglu_in, E5M2, 57344.0, True),
           1.5 * gb + 1.5 * gb + gb)


if __name__ == "__main__":
    main()
