"""Issue 13's small steps on the GPU, every row side by side in one run: milliseconds per
fwd+bwd step, taken as the wall time of 200 steps launched back to back followed by one
synchronisation (the larger of the host's and the GPU's time per step; at these sizes
the host's), median of 5 repeats.

Cases (bf16; the MLP is Linear+Bias, GELU(tanh), Linear+Bias, as in ``gpu_mlp.py``):

- ``tiny_linear``: one Linear 64->64 on 16 tokens, eager;
- ``tiny_mlp``: 64->256->64 on 16 tokens, eager, and in FP8 (``fusible.autocast`` /
  torchao float8 tensorwise) eager;
- ``mlp``: T=2048, H=1024, FF=4096, eager, ``torch.compile`` and compiled with CUDA graphs
  (``mode="reduce-overhead"``), bf16 and FP8.

The targets of issue 13 are ratios between rows (``targets`` in the results).

    python benchmarks/small_steps.py --output FILE
"""

import argparse
import contextlib
import gc
import json
import statistics
import time

import torch
from torch import nn

import fusible
from fusible import ops
from gpu_fp8 import torchao_fp8
from gpu_mlp import build, make_step, prepare

TINY = (16, 64, 256)
MLP = (2048, 1024, 4096)


def tiny_linear(kind: str, hidden: int, ffn: int) -> nn.Module:
    torch.manual_seed(0)
    ref = nn.Linear(hidden, hidden)
    if kind == "torch":
        return ref.to("cuda", torch.bfloat16)
    ours = ops.Sequential(ops.Linear(hidden, hidden))
    ours.load_state_dict({f"0.{k}": v for k, v in ref.state_dict().items()})
    return ours.to("cuda", torch.bfloat16)


def _maker(case: str, impl: str):
    if impl == "torchao":
        return torchao_fp8
    kind = "torch" if impl == "torch" else "fusible"
    if case == "tiny_linear":
        return lambda h, f: tiny_linear(kind, h, f)
    return lambda h, f: build(kind, h, f)


# (case, implementation, precision, mode)
ROWS = [("tiny_linear", "torch", "bf16", "eager"), ("tiny_linear", "fusible", "bf16", "eager"),
        ("tiny_mlp", "torch", "bf16", "eager"), ("tiny_mlp", "fusible", "bf16", "eager"),
        ("tiny_mlp", "fusible", "fp8", "eager"), ("tiny_mlp", "torchao", "fp8", "eager")]
ROWS += [("mlp", impl, precision, mode)
         for mode in ("eager", "compile", "reduce-overhead")
         for impl, precision in (("torch", "bf16"), ("fusible", "bf16"), ("fusible", "fp8"),
                                 ("torchao", "fp8"))]


def ms_per_step(step, steps: int = 200, repeats: int = 5) -> float:
    for _ in range(20):
        step()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(samples)


def run_row(case: str, impl: str, precision: str, mode: str) -> float:
    tokens, hidden, ffn = TINY if case.startswith("tiny") else MLP
    model = _maker(case, impl)(hidden, ffn)
    context = fusible.autocast if impl == "fusible" and precision == "fp8" else \
        contextlib.nullcontext
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    step = make_step(prepare(model, mode), list(model.parameters()), x, dy, context,
                     graphs=mode == "reduce-overhead")
    return ms_per_step(step)


def targets(ms: dict) -> dict:
    """Issue 13's ratios: each at most the bound given with it."""
    def ratio(a, b):
        return ms[a] / ms[b] if a in ms and b in ms else None

    return {
        "tiny_mlp eager, fusible / torch (<= 1.2)": ratio(
            "tiny_mlp_fusible_bf16_eager", "tiny_mlp_torch_bf16_eager"),
        "tiny_linear eager, fusible / torch": ratio(
            "tiny_linear_fusible_bf16_eager", "tiny_linear_torch_bf16_eager"),
        "tiny_mlp FP8 eager, fusible / torch bf16 (<= 2)": ratio(
            "tiny_mlp_fusible_fp8_eager", "tiny_mlp_torch_bf16_eager"),
        "tiny_mlp FP8 eager, fusible / torchao": ratio(
            "tiny_mlp_fusible_fp8_eager", "tiny_mlp_torchao_fp8_eager"),
        "mlp eager, fusible / torch (<= 1.2)": ratio(
            "mlp_fusible_bf16_eager", "mlp_torch_bf16_eager"),
        "mlp compiled, fusible / torch (<= 1.0)": ratio(
            "mlp_fusible_bf16_compile", "mlp_torch_bf16_compile"),
        "mlp compiled / eager, fusible (<= 1.0)": ratio(
            "mlp_fusible_bf16_compile", "mlp_fusible_bf16_eager"),
        "mlp CUDA graphs, fusible / torch (<= 1.0)": ratio(
            "mlp_fusible_bf16_reduce-overhead", "mlp_torch_bf16_reduce-overhead"),
        "mlp FP8 CUDA graphs, fusible / torchao (<= 1.0)": ratio(
            "mlp_fusible_fp8_reduce-overhead", "mlp_torchao_fp8_reduce-overhead"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    ms = {}
    for row in ROWS:
        name = "_".join(row)
        torch._dynamo.reset()
        gc.collect()
        try:
            ms[name] = run_row(*row)
            print(f"{name:45s} {ms[name]:8.3f} ms", flush=True)
        except Exception as error:  # one failing row must not hide the others
            ms[name] = None
            print(f"{name:45s} failed: {error!r}"[:400], flush=True)
        torch.cuda.empty_cache()
    ms = {k: v for k, v in ms.items() if v is not None}
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "ms": ms,
              "targets": targets(ms)}
    for name, value in result["targets"].items():
        print(f"{name:50s} {value if value is None else round(value, 3)}")
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
