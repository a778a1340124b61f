"""GPU: the transposed copy of FP8 data (the wgrad operand of a gathered input), PyTorch's
strided copy against the Triton kernel at a few tile sizes, in GB/s (read + write).

    PYTHONPATH=. python3 benchmarks/diagnostics/fp8_transpose.py
"""

import torch

from fusible.kernels.fp8_cast import transpose_bytes_triton


def gb_per_s(fn, data, iters=50) -> float:
    fn(data)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(data)
    end.record()
    torch.cuda.synchronize()
    return 2 * data.numel() * iters / (start.elapsed_time(end) * 1e6)


def main():
    for shape in ((16384, 8192), (8192, 8192), (2048, 1024)):
        data = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
        data = data.view(torch.float8_e4m3fn)
        row = {"pytorch": gb_per_s(lambda d: d.t().contiguous(), data)}
        for block in (32, 64, 128):
            row[f"triton_{block}"] = gb_per_s(lambda d: transpose_bytes_triton(d, block), data)
        print(shape, {k: round(v) for k, v in row.items()}, "GB/s", flush=True)


if __name__ == "__main__":
    main()
