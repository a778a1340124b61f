"""Host time per call of the pieces of an eager FP8 step (small tensors, so the host,
not the GPU, sets the pace): where a host-bound step spends its time.

    PYTHONPATH=. python3 benchmarks/diagnostics/host_costs.py   (from the repository root)
"""

import time

import torch

from fusible.kernels import fp8_cast
from fusible.quantization.casts.tensorwise import cast_tensorwise_torch
from fusible.quantization.tensor.float8_tensor import Float8Tensor


def per_call_us(fn, calls=500) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    e4m3, one = torch.float8_e4m3fn, torch.ones((), device="cuda")
    amax = torch.zeros((), device="cuda")
    data, transpose, scale_inv, has_t = fp8_cast.fp8_buffers(x, e4m3, True)
    a = x.to(e4m3)
    b = torch.randn(512, 512, device="cuda").to(e4m3).t()
    cases = {
        "torch.empty": lambda: torch.empty((256, 512), device="cuda", dtype=e4m3),
        "torch.zeros 0-d": lambda: torch.zeros((), device="cuda"),
        "amax kernel launch": lambda: fp8_cast._amax_kernel[(64,)](x, amax, x.numel(), 4096,
                                                                   BLOCK=4096),
        "cast kernel launch": lambda: fp8_cast._cast_kernel[(16,)](
            x, amax, data, transpose, scale_inv, 256, 512, 448.0, HAS_T=has_t, HAS_DATA=True,
            BLOCK_M=64, BLOCK_N=128),
        "vector_norm inf": lambda: torch.linalg.vector_norm(x, float("inf")),
        "cast_to_fp8_triton": lambda: fp8_cast.cast_to_fp8_triton(x, e4m3, 448.0, True),
        "cast_tensorwise_torch": lambda: cast_tensorwise_torch(x, e4m3, True),
        "cast_to_fp8 (custom op)": lambda: torch.ops.fusible.cast_to_fp8.default(x, e4m3, True),
        "_scaled_mm": lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16, use_fast_accum=True),
        "torch.mm bf16": lambda: torch.mm(x, x.t()),
        "Float8Tensor()": lambda: Float8Tensor(data, scale_inv, torch.bfloat16, transpose),
    }
    for name, fn in cases.items():
        print(f"{name:<32} {per_call_us(fn):8.1f} us")


def profile_step(path: str, tokens=2048, hidden=1024, ffn=4096):
    """torch.profiler trace (Chrome JSON at ``path``) and table of eager FP8 steps."""
    from fp8_diag import mlp_problem  # this script's folder is on sys.path
    from torch.profiler import ProfilerActivity, profile

    import fusible

    model, x, dy = mlp_problem(tokens, hidden, ffn)

    def step():
        with fusible.autocast():
            model(x).backward(dy)

    for fp8 in (False, True):
        run = step if fp8 else (lambda: model(x).backward(dy))
        print(f"== fp8={fp8}: {per_call_us(run, 50):.0f} us per step (host)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))


if __name__ == "__main__":
    import os
    import sys
    main()
    if "--profile" in sys.argv:
        profile_step(os.path.join(os.environ.get("OUT", "out"), "fp8_step_trace.json"))
