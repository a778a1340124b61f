"""Where the time of a CUDA-graph step goes at the small MLP shape (T=2048, H=1024,
FF=4096, bf16; torch.nn and fusible compiled with ``mode="reduce-overhead"``, FP8 fusible
under ``fusible.autocast`` too), where the replayed kernels take about 0.16 ms and the
step several times that:

- per row, the host time of a step launched on an idle GPU (the forward, the backward),
  and the step's time with the GPU synchronised, medians of 50 steps;
- the functions with the most time of their own over 50 steps (cProfile; its overhead
  inflates every figure, compare them with each other).

    PYTHONPATH=.:benchmarks python3 benchmarks/diagnostics/graphs_host.py
"""

import contextlib
import statistics
import time

import torch

import fusible
from gpu_idle import host_profile
from gpu_mlp import build, make_step, prepare

SHAPE = (2048, 1024, 4096)
ROWS = (("torch", contextlib.nullcontext), ("fusible", contextlib.nullcontext),
        ("fusible", fusible.autocast))


def timings(step, steps: int = 50) -> tuple:
    """``(host ms, synchronised ms)``: medians of ``steps`` steps each."""
    host, synced = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - start)
    return statistics.median(host) * 1e3, statistics.median(synced) * 1e3


def main() -> None:
    tokens, hidden, ffn = SHAPE
    for kind, context in ROWS:
        label = f"{kind}{'_fp8' if context is fusible.autocast else ''}_reduce-overhead"
        model = build(kind, hidden, ffn)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        step = make_step(prepare(model, "reduce-overhead"), list(model.parameters()), x, dy,
                         context, graphs=True)
        for _ in range(10):
            step()
        host, synced = timings(step)
        print(f"== {label}: host {host:.3f} ms a step, synchronised {synced:.3f} ms")
        print(host_profile(step, steps=50, top=30))


if __name__ == "__main__":
    main()
