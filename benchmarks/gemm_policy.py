"""GPU: calibrate the FP8 GEMM policy (``fusible.Fp8GemmPolicy``) against measured steps.

For a grid of GEMM shapes (``K`` input, ``N`` output features, from ``K N / (K + N)`` of 192
up to 3186) and two token counts, times the forward and backward of a fusible layer in
bf16 and in FP8 with every GEMM forced to FP8 (``Float8CurrentScaling(gemm_policy=None)``),
two layer kinds: a lone ``Linear`` (its input cast a pass of its own) and ``RMSNorm`` +
``Linear`` (the norm writes the GEMM's FP8 input, as before a QKV or gate/up projection).
Each row reports the FP8 speedup, the policy's choice for the shape, and whether they
agree (FP8 chosen exactly where it is faster); the summary gives the measured crossover
(the largest ``K N / (K + N)`` where FP8 loses, the smallest where it wins) next to the
policy's threshold. Median of ``triton.testing.do_bench`` over steps with a fixed output
gradient.

    python benchmarks/gemm_policy.py --output benchmarks/results/gemm_policy_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

import fusible
from fusible import ops
from gpu_mlp import make_step

SHAPES = [(256, 768), (512, 2048), (1024, 1024), (1024, 4096), (1536, 1536), (2048, 2048),
          (2560, 2560), (2048, 8192), (4096, 4096), (4096, 14336), (14336, 4096)]
TOKENS = (2048, 8192)
KINDS = ("linear", "norm_linear")


def _model(kind: str, k: int, n: int):
    layers = [ops.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)]
    if kind == "norm_linear":
        layers.insert(0, ops.RMSNorm(k, device="cuda", dtype=torch.bfloat16))
    return ops.Sequential(*layers)


def time_step(kind: str, k: int, n: int, tokens: int, fp8: bool) -> float:
    """Median ms of one forward and backward (``gpu_mlp.make_step``'s step)."""
    import triton
    model = _model(kind, k, n)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    recipe = fusible.Float8CurrentScaling(gemm_policy=None)
    context = (lambda: fusible.autocast(recipe=recipe)) if fp8 else contextlib.nullcontext
    step = make_step(model, list(model.parameters()), x, dy, context)
    for _ in range(3):
        step()
    return triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")


def crossover(rows: list) -> dict:
    """The largest size where FP8 lost and the smallest where it won, per layer kind."""
    out = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        lost = [r["size"] for r in mine if r["speedup"] < 1]
        won = [r["size"] for r in mine if r["speedup"] >= 1]
        out[kind] = {"largest losing size": max(lost, default=None),
                     "smallest winning size": min(won, default=None),
                     "disagreements": sum(not r["agrees"] for r in mine)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="out/gemm_policy.json")
    args = parser.parse_args()
    policy = fusible.Fp8GemmPolicy()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "policy threshold": policy.threshold, "rows": []}
    for kind in KINDS:
        for k, n in SHAPES:
            for tokens in TOKENS:
                bf16, fp8 = (time_step(kind, k, n, tokens, f) for f in (False, True))
                chooses_fp8 = policy.why_high_precision(k, n) is None
                row = {"kind": kind, "K": k, "N": n, "tokens": tokens,
                       "size": k * n / (k + n), "bf16_ms": bf16, "fp8_ms": fp8,
                       "speedup": bf16 / fp8, "policy_fp8": chooses_fp8,
                       "agrees": chooses_fp8 == (fp8 < bf16)}
                results["rows"].append(row)
                print(row, flush=True)
                results["crossover"] = crossover(results["rows"])
                with open(args.output, "w") as f:
                    json.dump(results, f, indent=1)
    print(results["crossover"])


if __name__ == "__main__":
    main()
