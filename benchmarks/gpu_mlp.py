"""GPU: fwd+bwd of Linear+Bias+GELU(tanh)+Linear+Bias in bf16, fusible vs torch.nn.

Each runs eagerly, under ``torch.compile`` (default mode) and under
``torch.compile(mode="reduce-overhead")`` (CUDA graphs), all with fullgraph=True.

The method of the reference figures the README quotes: input and weights require grad, one
forward + backward with a fixed output gradient, no optimizer; ``ms`` is the median
of triton.testing.do_bench, ``tflops`` counts the 6 GEMMs, ``peak_gib`` is peak
allocated memory during a step, ``first3_s`` the wall time of the first three steps.

    python benchmarks/gpu_mlp.py --output benchmarks/results/gpu_mlp_h200.json
"""

import argparse
import contextlib
import gc
import json
import os
import time

import torch
import triton.testing
from torch import nn

from fusible import ops

SHAPES = [(16384, 4096, 16384), (2048, 1024, 4096)]


def build(kind: str, hidden: int, ffn: int) -> nn.Module:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(approximate="tanh"),
                        nn.Linear(ffn, hidden))
    if kind == "torch":
        return ref.to("cuda", torch.bfloat16)
    ours = ops.Sequential(ops.Linear(hidden, ffn), ops.GELU(approximate="tanh"),
                          ops.Linear(ffn, hidden))
    ours.load_state_dict(ref.state_dict())
    return ours.to("cuda", torch.bfloat16)


MODES = ("eager", "compile", "reduce-overhead")


def prepare(model, mode: str):
    """The model as it runs in ``mode``: eager, torch.compile, or compile with CUDA graphs."""
    if mode == "eager":
        return model
    return torch.compile(model, fullgraph=True, mode=None if mode == "compile" else mode)


def make_step(run, params, x, dy, context=contextlib.nullcontext, graphs: bool = False):
    """One fwd+bwd step as every GPU benchmark here times it: ``run(x)`` inside
    ``context()``, the fixed output gradient ``dy``, the gradients of ``x`` and ``params``
    reset rather than accumulated; ``graphs``: a CUDA-graph step begins first."""
    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with context():
            y = run(x)
        y.backward(dy)
        x.grad = None
        for p in params:
            p.grad = None
    return step


def measure(model, tokens: int, hidden: int, ffn: int, mode: str = "eager",
            context=contextlib.nullcontext, snapshot: str | None = None,
            flops: float | None = None) -> dict:
    """Time and peak memory of fwd+bwd steps; each step runs inside ``context()``.
    ``flops``: of one step (default: the MLP's 6 GEMMs).

    ``snapshot``: a path for the allocator history of the step whose peak is reported
    (``torch.cuda.memory._dump_snapshot``), to see what is alive at the peak.
    """
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    step = make_step(prepare(model, mode), list(model.parameters()), x, dy, context,
                     graphs=mode == "reduce-overhead")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    first3 = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=100000)
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    ms = triton.testing.do_bench(step, warmup=100, rep=1000, return_mode="median")
    flops = flops or 3 * 2 * tokens * hidden * ffn * 2
    return {"ms": ms, "tflops": flops / ms / 1e9, "peak_gib": peak, "first3_s": first3}


def measure_rows(key: str, rows, build, shape: tuple, flops: float, results: dict,
                 output: str) -> None:
    """Measure each row side by side (``build(row) -> (model, mode, context)``; ``shape``:
    ``measure``'s ``(tokens, hidden, ffn)``) into ``results[key][row]``; a row that cannot
    run is reported as its error and the rest go on; the results file is rewritten after
    each row (a run cut short keeps what it measured)."""
    for row in rows:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        model = None
        try:
            model, mode, context = build(row)
            results.setdefault(key, {})[row] = measure(model, *shape, mode, context,
                                                       flops=flops)
        except Exception as error:  # a row that cannot run is reported, the rest go on
            results.setdefault(key, {})[row] = {"error": repr(error)[:300]}
        del model
        print(key, row, results[key][row], flush=True)
        with open(output, "w") as f:
            json.dump(results, f, indent=1)


def profile_step(step, title: str, path: str, rows: int = 25) -> None:
    """Append the ``rows`` costliest kernels of three ``step()`` calls (after three to warm
    up), by GPU time, to ``path`` under the heading ``title``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    with open(path, "a") as f:
        f.write(f"== {title}, 3 steps\n")
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows))
        f.write("\n")


def check_same(tokens, hidden, ffn) -> float:
    """Relative difference of fusible's output vs torch.nn's on the same weights."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        a, b = build("torch", hidden, ffn)(x).float(), build("fusible", hidden, ffn)(x).float()
    return ((a - b).norm() / a.norm()).item()


def profile(tokens: int, hidden: int, ffn: int, path: str) -> None:
    """Write the per-op CPU and GPU time of a few steps of each model to ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with open(path, "w") as f:
        for kind in ("torch", "fusible"):
            model = build(kind, hidden, ffn)
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)
            for _ in range(3):
                model(x).sum().backward()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    model(x).sum().backward()
                torch.cuda.synchronize()
            f.write(f"== {kind} T={tokens} H={hidden} FF={ffn}, 5 steps\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            f.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/gpu_mlp.json")
    parser.add_argument("--profile", help="also write a profile of the small shape here")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    if args.profile:
        profile(*SHAPES[1], args.profile)
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
               "triton": triton.__version__}
    for tokens, hidden, ffn in SHAPES:
        shape = f"T{tokens}_H{hidden}_FF{ffn}"
        results[f"rel_diff_vs_torch_{shape}"] = check_same(tokens, hidden, ffn)
        for mode in MODES:
            for kind in ("torch", "fusible"):
                torch._dynamo.reset()
                gc.collect()  # earlier compiled models are freed by the cyclic GC
                model = build(kind, hidden, ffn)
                results[f"bf16_{mode}_{kind}_{shape}"] = measure(model, tokens, hidden, ffn, mode)
                del model
                torch.cuda.empty_cache()
            ratio = (results[f"bf16_{mode}_fusible_{shape}"]["ms"]
                     / results[f"bf16_{mode}_torch_{shape}"]["ms"])
            results[f"ratio_fusible_over_torch_{mode}_{shape}"] = ratio
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    for key, value in results.items():
        if isinstance(value, dict):
            print(f"{key:<50} {value['ms']:8.3f} ms {value['tflops']:7.1f} TFLOP/s "
                  f"{value['peak_gib']:6.2f} GiB first3 {value['first3_s']:.2f} s")
        else:
            print(f"{key:<50} {value}")


if __name__ == "__main__":
    main()
