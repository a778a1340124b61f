"""GPU: pipeline parallelism of Llama-3-8B FFN blocks (x + RMSNorm + SwiGLU FFN, H=4096,
FF=14336, no bias), each stage compiled in place (fullgraph), bf16 and FP8, 8 microbatches
of 8192 tokens: ``Schedule1F1B`` (one stage of 2 blocks per GPU) against the zero-bubble
``ScheduleZBVZeroBubble`` (two stages of 1 block per GPU, the backward split into dgrad and
deferred wgrad by ``fusible.pipeline_stage``) and ``ScheduleInterleaved1F1B`` (the same
stages without the split).

Per schedule: step time (the slowest rank's) and bubble fraction, ``1 - busy / step``, where
``busy`` is the rank's blocks run over the same microbatches without a pipeline (measured
alone). Target (issue 18): the zero-bubble schedule at least 10% faster than 1F1B on two
GPUs. With one GPU every stage sits on rank 0 (no communication, no bubble): a check of
the code path and of the split's own cost.

    python benchmarks/gpu_pipeline.py --output benchmarks/results/gpu_pipeline_h200x2.json
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fusible  # noqa: E402
from fusible import ops  # noqa: E402
from fusible.testing.distributed import no_nvlink_multicast, run_distributed  # noqa: E402

HIDDEN, FFN, MB_TOKENS, MICROBATCHES, BLOCKS_PER_GPU = 4096, 14336, 8192, 8, 2
WARMUP, STEPS = 3, 8


class Blocks(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(
            ops.Sequential(ops.RMSNorm(HIDDEN), ops.BasicLinear(HIDDEN, 2 * FFN), ops.SwiGLU(),
                           ops.BasicLinear(FFN, HIDDEN)) for _ in range(n))

    def forward(self, x):
        for block in self.layers:
            x = x + block(x)
        return x


def loss_fn(y, target):
    return (y.float() * target).mean()


def _stages(name: str, rank: int, ws: int) -> tuple:
    """``(this rank's stage indices, number of stages, blocks per stage)``."""
    if name == "1F1B":
        return [rank], ws, BLOCKS_PER_GPU
    if name == "ZBVZeroBubble":
        return [rank, 2 * ws - 1 - rank], 2 * ws, BLOCKS_PER_GPU // 2
    return [rank, rank + ws], 2 * ws, BLOCKS_PER_GPU // 2  # Interleaved1F1B


def _timed(fn) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(STEPS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / STEPS * 1e3


def run_schedule(name: str, fp8: bool, rank: int, ws: int) -> dict:
    device = torch.device("cuda", rank)
    mine, num_stages, per_stage = _stages(name, rank, ws)
    torch.manual_seed(0)
    modules = {s: Blocks(per_stage).to(device, torch.bfloat16) for s in mine}
    for m in modules.values():
        m.compile(fullgraph=True)
    make = fusible.pipeline_stage if name == "ZBVZeroBubble" else pipelining.PipelineStage
    stages = [make(modules[s], s, num_stages, device) for s in mine]
    cls = {"1F1B": pipelining.Schedule1F1B, "ZBVZeroBubble": pipelining.ScheduleZBVZeroBubble,
           "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B}[name]
    schedule = cls(stages if len(stages) > 1 else stages[0], MICROBATCHES, loss_fn=loss_fn)
    x = torch.randn(MICROBATCHES * MB_TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
    target = torch.randn_like(x)
    params = [p for m in modules.values() for p in m.parameters()]

    def step():
        if rank == 0 and os.environ.get("PIPELINE_DEBUG"):
            print(name, fp8, "allocated GiB", torch.cuda.memory_allocated() / 2**30, flush=True)
        with fusible.autocast(enabled=fp8):
            schedule.step(*([x] if 0 in mine else []),  # inputs: the first stage's
                          target=target if num_stages - 1 in mine else None)
        for p in params:
            p.grad = None

    step_ms = _timed(step)
    assert fusible.pending_wgrad() == []
    torch.cuda.reset_peak_memory_stats()
    step()
    peak = torch.cuda.max_memory_allocated() / 2**30
    busy = _busy(modules, fp8, x[:MB_TOKENS], params)
    times = [None] * ws
    dist.all_gather_object(times, (step_ms, busy, peak))
    step_max = max(t[0] for t in times)
    return {"schedule": name, "fp8": fp8, "step_ms": round(step_max, 2),
            "bubble": [round(1 - t[1] / step_max, 3) for t in times],
            "busy_ms": [round(t[1], 2) for t in times],
            "peak_gib": [round(t[2], 2) for t in times]}


def _busy(modules, fp8, xs, params) -> float:
    """This rank's blocks over the step's microbatches, one after another, no pipeline."""
    x = xs.detach().requires_grad_()
    blocks = [modules[s] for s in sorted(modules)]

    def work():
        for _ in range(MICROBATCHES):
            for m in blocks:
                with fusible.autocast(enabled=fp8):
                    y = m(x)
                y.backward(torch.ones_like(y))
        for p in params:
            p.grad = None

    return _timed(work)


def split_cost(fp8: bool) -> dict:
    """One block fwd + bwd, one lane against the split (dgrad, then the wgrads), compiled:
    the same GEMMs, so the same time; and the same gradients, bit for bit."""
    torch.manual_seed(0)
    model = Blocks(1).to("cuda", torch.bfloat16)
    model.compile(fullgraph=True)
    x = torch.randn(MB_TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x)
    out = {}
    for split in (False, True):
        def step():
            with fusible.autocast(enabled=fp8), fusible.split_backward(split):
                y = model(x)
            y.backward(dy)
            fusible.run_deferred_wgrad()
        step_ms = _timed(step)
        model.zero_grad(set_to_none=True)
        x.grad = None
        step()
        out[split] = step_ms, [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        x.grad = None
    same = all(torch.equal(a, b) for a, b in zip(out[False][1], out[True][1]))
    return {"fp8": fp8, "one_lane_ms": round(out[False][0], 3),
            "split_ms": round(out[True][0], 3), "bitwise_equal": same}


def worker(rank: int, ws: int) -> dict:
    torch.cuda.set_device(rank)
    torch._dynamo.config.recompile_limit = 64
    results = {"world_size": ws, "microbatches": MICROBATCHES, "mb_tokens": MB_TOKENS,
               "schedules": [], "split_cost": []}
    for fp8 in (False, True):
        for name in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
            results["schedules"].append(run_schedule(name, fp8, rank, ws))
            if rank == 0:
                print(results["schedules"][-1], flush=True)
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        if rank == 0:
            results["split_cost"].append(split_cost(fp8))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/gpu_pipeline.json")
    args = parser.parse_args()
    no_nvlink_multicast()
    ws = min(torch.cuda.device_count(), 2)
    import gpu_pipeline  # the children import worker by module name, not from __main__
    results = run_distributed(gpu_pipeline.worker, ws, backend="nccl", timeout=600)[0]
    rows = {(r["schedule"], r["fp8"]): r for r in results["schedules"]}
    for fp8 in (False, True):
        base, zb = rows[("1F1B", fp8)]["step_ms"], rows[("ZBVZeroBubble", fp8)]["step_ms"]
        results[f"zbv_speedup_vs_1f1b_{'fp8' if fp8 else 'bf16'}"] = round(base / zb, 3)
    print(json.dumps(results, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
