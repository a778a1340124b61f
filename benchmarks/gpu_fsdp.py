"""GPU: FSDP2 on every GPU of the machine against one GPU without FSDP, the same per-GPU
batch: a stack of Llama-3-8B FFN blocks (x + RMSNorm + SwiGLU FFN, H=4096, FF=14336, no
bias), each block compiled (fullgraph), fwd+bwd, bf16 and FP8.

One GPU: bf16 parameters, no communication. FSDP2: float32 parameters sharded per block,
bf16 compute and float32 gradient reduction (MixedPrecisionPolicy); FP8 runs under
``fusible.autocast()`` with the weights all-gathered in FP8 (``fsdp_float8_all_gather``).
Per GPU: step time, tokens/s, peak memory, bytes all-gathered per step. Targets (issue
17): FSDP2's per-GPU throughput at least 0.9x one GPU's, FP8 all-gather bytes half of
bf16's, FP8 throughput at least 1.3x bf16's. With one GPU, FSDP2 runs at world size 1
(no all-gather: a check of the code path and its overhead, not of the overlap).

    python benchmarks/gpu_fsdp.py --output benchmarks/results/fsdp_h200x2.json
"""

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fusible  # noqa: E402
from fusible import ops  # noqa: E402
from fusible.testing.distributed import (all_gather_bytes, no_nvlink_multicast,  # noqa: E402
                                         run_distributed)

HIDDEN, FFN, TOKENS, LAYERS = 4096, 14336, 8192, 4
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class FFNStack(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.layers = nn.ModuleList(
            ops.Sequential(ops.RMSNorm(HIDDEN), ops.BasicLinear(HIDDEN, 2 * FFN), ops.SwiGLU(),
                           ops.BasicLinear(FFN, HIDDEN))
            for _ in range(LAYERS)).to("cuda", dtype)

    def forward(self, x):
        for block in self.layers:
            x = x + block(x)
        return x


def _build(fsdp: bool, fp8: bool, world_size: int) -> FFNStack:
    model = FFNStack(torch.float32 if fsdp else torch.bfloat16)
    if fsdp:
        if fp8:
            fusible.fsdp_float8_all_gather(model)
        mesh = init_device_mesh("cuda", (world_size,))
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=POLICY)
        fully_shard(model, mesh=mesh, mp_policy=POLICY)
    # Each fusible block compiles its own graph (docs/compile.md, Limits)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               4 * LAYERS)
    for block in model.layers:
        block.compile(fullgraph=True)
    return model


def _measure(model, fp8: bool, iters: int = 10) -> dict:
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        with fusible.autocast(enabled=fp8):
            y = model(x)
        y.backward(dy)
        for p in model.parameters():
            p.grad = None
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with all_gather_bytes() as gathered:
        step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    times = []
    for _ in range(3):  # the median of three timed runs of ``iters`` steps
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    ms = sorted(times)[1]
    return {"ms": ms, "tokens_per_s": TOKENS / ms * 1e3, "peak_gib": peak,
            "all_gather_bytes_per_step": gathered[0]}


def bench(rank, world_size):
    results = {}
    for fp8 in (False, True):
        name = "fp8" if fp8 else "bf16"
        for fsdp in (False, True):
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            key = f"{name}_fsdp{world_size}" if fsdp else f"{name}_one_gpu"
            try:
                results[key] = _measure(_build(fsdp, fp8, world_size), fp8)
            except Exception as error:  # reported, and the other rows go on
                results[key] = {"error": repr(error)[:300], "ms": float("nan")}
            if rank == 0:
                print(key, results[key], flush=True)
    return results


def _summary(per_rank: list, world_size: int) -> dict:
    slowest = {k: max(r[k]["ms"] for r in per_rank) for k in per_rank[0]}
    out = {}
    for name in ("bf16", "fp8"):
        out[f"per_gpu_throughput_vs_one_gpu_{name}"] = (
            slowest[f"{name}_one_gpu"] / slowest[f"{name}_fsdp{world_size}"])
    out["fp8_over_bf16_throughput_fsdp"] = (slowest[f"bf16_fsdp{world_size}"]
                                            / slowest[f"fp8_fsdp{world_size}"])
    bf16_bytes = per_rank[0][f"bf16_fsdp{world_size}"].get("all_gather_bytes_per_step")
    fp8_bytes = per_rank[0][f"fp8_fsdp{world_size}"].get("all_gather_bytes_per_step")
    out["fp8_over_bf16_all_gather_bytes"] = (fp8_bytes / bf16_bytes if bf16_bytes and fp8_bytes
                                             is not None else None)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/gpu_fsdp.json")
    args = parser.parse_args()
    no_nvlink_multicast()  # spawned ranks inherit it
    world_size = torch.cuda.device_count()
    import gpu_fsdp  # the children import bench by module name, not from __main__
    per_rank = run_distributed(gpu_fsdp.bench, world_size, backend="nccl", timeout=1200)
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "world_size": world_size,
           "shape": {"tokens_per_gpu": TOKENS, "hidden": HIDDEN, "ffn": FFN, "layers": LAYERS},
           "ranks": per_rank, **_summary(per_rank, world_size)}
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "ranks"}, indent=1))


if __name__ == "__main__":
    main()
