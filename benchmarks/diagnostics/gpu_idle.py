"""Where a step's GPU time goes besides kernels: the GPU's idle gaps in one profiled
fwd+bwd step of the zoo's Llama-3-8B FFN block (fusible, FP8 eager and bf16 eager), the
largest gaps with the kernels around them, and the host time of a step.

    PYTHONPATH=.:benchmarks python3 benchmarks/diagnostics/gpu_idle.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from zoo import build_row

CUDA = torch.autograd.DeviceType.CUDA


def step_fn(model, context, x, dy):
    def step():
        with context():
            y = model(x)
        y.backward(dy)
        x.grad = None
        for p in model.parameters():
            p.grad = None
    return step


def report(row: str, tokens: int = 8192, hidden: int = 4096, ffn: int = 14336) -> None:
    model, _, context = build_row(row, "llama_ffn", hidden, ffn)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    step = step_fn(model, context, x, dy)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - start) * 1e3  # launched, not waited for
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == CUDA),
                     key=lambda e: e.time_range.start)
    busy = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3
    gaps = sorted(((b.time_range.start - a.time_range.end) / 1e3, a.name[:40], b.name[:40])
                  for a, b in zip(kernels, kernels[1:]))[::-1]
    print(f"== {row}: host {host_ms:.2f} ms to launch a step; GPU span {span:.2f} ms, "
          f"kernels {busy:.2f} ms, idle {span - busy:.2f} ms over {len(kernels)} kernels")
    for gap, before, after in gaps[:8]:
        print(f"   gap {gap:6.3f} ms after {before:40s} before {after}")


if __name__ == "__main__":
    for row in ("fusible_fp8_eager", "fusible_bf16_eager", "torchao_tensorwise"):
        report(row)
