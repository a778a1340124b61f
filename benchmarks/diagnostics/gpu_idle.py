"""Where a step's GPU time goes besides kernels, for a zoo block (by default the
Llama-3-8B FFN at 8192 tokens: fusible FP8 and bf16 eager, torch.compile, torchao
tensorwise compiled):

- the host time to launch one step, and the GPU's idle gaps in one step launched on an idle
  GPU (the largest, with the kernels around them);
- the steady state that ``do_bench`` measures: ten steps launched back to back (the L2
  flushed between them, as ``do_bench`` does), their kernel time per step against their
  span per step, which is what a median step costs;
- every host-device synchronisation inside a step (``torch.cuda.set_sync_debug_mode``),
  each of which drains the launch queue;
- where the host time goes: the functions with the most time of their own over 20 steps
  (cProfile; its overhead inflates every figure, compare them with each other).

    PYTHONPATH=.:benchmarks python3 benchmarks/diagnostics/gpu_idle.py [CONFIG_INDEX ROW...]

(``CONFIG_INDEX``: an index into the zoo's ``CONFIGS``; ``ROW``: zoo row names.)
"""

import cProfile
import io
import pstats
import sys
import time
import warnings

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from gpu_mlp import make_step, prepare
from zoo import CONFIGS, build_row

CUDA = torch.autograd.DeviceType.CUDA
STEADY_STEPS = 10


def kernels_of(prof) -> list:
    return sorted((e for e in prof.events() if e.device_type == CUDA),
                  key=lambda e: e.time_range.start)


def busy_and_span(kernels) -> tuple:
    busy = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3
    return busy, (kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3


def syncs_in(step) -> list:
    """The messages of the synchronisations one step makes."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0][:100] for w in caught]


def warm_step(row: str, config: tuple = CONFIGS[0]):
    """One fwd+bwd step of a zoo row on ``config``, run five times (compiled, warm)."""
    name, hidden, ffn, tokens = config
    model, mode, context = build_row(row, name, hidden, ffn)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    step = make_step(prepare(model, mode), list(model.parameters()), x, dy, context)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    return step


def report(row: str, config: tuple = CONFIGS[0]) -> None:
    step = warm_step(row, config)
    start = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - start) * 1e3  # launched, not waited for
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = kernels_of(prof)
    busy, span = busy_and_span(kernels)
    gaps = sorted(((b.time_range.start - a.time_range.end) / 1e3, a.name[:40], b.name[:40])
                  for a, b in zip(kernels, kernels[1:]))[::-1]
    print(f"== {row} {config}: host {host_ms:.2f} ms to launch a step; one step from idle: GPU span "
          f"{span:.2f} ms, kernels {busy:.2f} ms, idle {span - busy:.2f} ms over "
          f"{len(kernels)} kernels")
    for gap, before, after in gaps[:8]:
        print(f"   gap {gap:6.3f} ms after {before:40s} before {after}")
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEADY_STEPS):
            flush.zero_()
            step()
        torch.cuda.synchronize()
    busy, span = busy_and_span(kernels_of(prof))
    bench = triton.testing.do_bench(step, warmup=100, rep=1000, return_mode="median")
    print(f"   steady: {STEADY_STEPS} steps back to back: span {span / STEADY_STEPS:.2f} ms/step, "
          f"kernels {busy / STEADY_STEPS:.2f} ms/step (L2 flush included); do_bench median "
          f"{bench:.2f} ms")
    syncs = syncs_in(step)
    print(f"   synchronisations in a step: {len(syncs)}" + "".join(f"\n     {s}" for s in syncs))
    print(host_profile(step))


def host_profile(step, steps: int = 20, top: int = 18, sort: str = "tottime",
                 restrict: tuple = ()) -> str:
    """cProfile's table of ``steps`` calls of ``step``, the ``top`` rows by ``sort``
    (among the functions whose path matches the ``restrict`` regular expressions)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(*restrict, top)
    lines = [line[:160] for line in text.getvalue().splitlines() if line.strip()]
    return "\n".join(f"   | {line}" for line in lines[2:])


if __name__ == "__main__":
    index, *rows = sys.argv[1:] or ["0"]
    for row in rows or ("fusible_fp8_eager", "fusible_bf16_eager", "torch_compile",
                        "torchao_tensorwise"):
        report(row, CONFIGS[int(index)])
