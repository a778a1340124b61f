"""GPU: tensor-parallel MLP block (column Linear + GELU(tanh) + row Linear) on two GPUs
against the same block on one GPU, fwd+bwd, compiled.

The same global batch in both: one GPU runs T tokens through the full block; with TP=2 and
sequence parallelism each GPU holds T/2 tokens of the input and half of every weight.
``throughput_vs_one_gpu`` is one GPU's time over the TP step's time (2.0 would be perfect
scaling). Under FP8 the input is gathered in FP8 (one scale for the group).

    python benchmarks/gpu_tp.py --output benchmarks/results/gpu_tp_h200x2.json
"""

import argparse
import functools
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fusible  # noqa: E402
from fusible import ops  # noqa: E402
from fusible.testing.distributed import no_nvlink_multicast, run_distributed  # noqa: E402

TOKENS, HIDDEN, FFN = 16384, 8192, 28672


def _block(tp: bool, sp: bool):
    kwargs = ({"sequence_parallel": sp} if tp else {})
    col = {"tensor_parallel_mode": "column", **kwargs} if tp else {}
    row = {"tensor_parallel_mode": "row", **kwargs} if tp else {}
    return ops.Sequential(ops.Linear(HIDDEN, FFN, **col), ops.GELU(approximate="tanh"),
                          ops.Linear(FFN, HIDDEN, **row)).to("cuda", torch.bfloat16)


def _measure(model, tokens: int, fp8: bool) -> dict:
    """Compiled fwd+bwd time and peak memory, as ``gpu_mlp.measure`` takes them."""
    from gpu_mlp import measure  # benchmarks/ is on the path (this script's folder)
    result = measure(model, tokens, HIDDEN, FFN, "compile",
                     functools.partial(fusible.autocast, enabled=fp8))
    return {"ms": result["ms"], "peak_gib": result["peak_gib"]}


def bench(rank, world_size):
    results = {}
    for fp8 in (False, True):
        name = "fp8" if fp8 else "bf16"
        dist.barrier()
        if rank == 0:  # one GPU, the whole batch, no communication
            _fresh()
            results[f"{name}_one_gpu"] = _measure(_block(False, False), TOKENS, fp8)
        dist.barrier()
        _fresh()
        results[f"{name}_tp{world_size}_sp"] = _measure(_block(True, True),
                                                        TOKENS // world_size, fp8)
    return results


def _fresh():
    """Earlier compiled models are freed (by the cyclic GC) and not in the next peak."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/gpu_tp.json")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    no_nvlink_multicast()  # spawned ranks inherit it
    import gpu_tp  # the children import bench by module name, not from __main__
    # rank 1 waits at a barrier while rank 0 compiles and measures alone: minutes
    per_rank = run_distributed(gpu_tp.bench, 2, backend="nccl", timeout=1200)
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "shape": {"tokens": TOKENS, "hidden": HIDDEN, "ffn": FFN}, "ranks": per_rank}
    for name in ("bf16", "fp8"):
        one = per_rank[0][f"{name}_one_gpu"]["ms"]
        tp = max(r[k]["ms"] for r in per_rank for k in r if k.startswith(f"{name}_tp"))
        out[f"throughput_vs_one_gpu_{name}"] = one / tp
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
