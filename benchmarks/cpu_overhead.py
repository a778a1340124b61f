"""Eager CPU overhead: small fusible Sequentials vs the equivalent torch.nn modules.

Tiny shapes make the time per call mostly Python and dispatch overhead. Each
case runs forward + backward (weights require grad, the input does not) or a
no-grad forward, and forward + backward compiled (Inductor, ``fullgraph=True``, both
models; the row also gives fusible's eager time, which the compiled path should not
exceed); the figure is the median over repeats of the mean time per call. Results go to
out/cpu_overhead.json unless ``--output`` says where (the committed figures are
benchmarks/results/cpu_overhead.json).

    python benchmarks/cpu_overhead.py [--calls 2000] [--repeats 7] [--output out/cpu_overhead.json]
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch
from torch import nn

from fusible import ops

RESULTS = "out/cpu_overhead.json"  # committed figures: --output benchmarks/results/...


def cases():
    """name -> (torch module, equivalent fusible Sequential, input shape)."""
    def mlp_pair():
        ref = nn.Sequential(nn.Linear(64, 256), nn.GELU(approximate="tanh"), nn.Linear(256, 64))
        ours = ops.Sequential(ops.Linear(64, 256), ops.GELU(approximate="tanh"),
                              ops.Linear(256, 64))
        ours.load_state_dict(ref.state_dict())
        return ref, ours

    def block_pair():
        ref = _TorchBlock(64, 256)
        ours = ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 256), ops.GELU(approximate="tanh"),
                              ops.Linear(256, 64), ops.AddExtraInput())
        ours.load_state_dict(ref.state_dict())
        return ref, ours

    linear_ref = nn.Sequential(nn.Linear(64, 64))
    linear_ours = ops.Sequential(ops.Linear(64, 64))
    linear_ours.load_state_dict(linear_ref.state_dict())
    return {"linear_64x64": (linear_ref, linear_ours, (16, 64)),
            "mlp_64_256_64": (*mlp_pair(), (16, 64)),
            "residual_block_64_256": (*block_pair(), (16, 64))}


class _TorchBlock(nn.Module):
    """``x + Linear(GELU(Linear(LayerNorm(x))))`` with the same state_dict names as ours."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, ffn),
                                  nn.GELU(approximate="tanh"), nn.Linear(ffn, hidden))

    def forward(self, x, residual):
        return self.body(x) + residual

    def state_dict(self, *args, **kwargs):
        return {k.removeprefix("body."): v for k, v in super().state_dict().items()}


def per_call_us(step, calls: int, repeats: int) -> float:
    for _ in range(max(calls // 10, 20)):
        step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def _inputs(model, x):
    return (x, x) if isinstance(model, _TorchBlock) or (
        isinstance(model, ops.Sequential) and any(isinstance(m, ops.AddExtraInput)
                                                  for m in model)) else (x,)


def train_step(model, x, original=None):
    inputs = _inputs(original or model, x)  # original: the module a compiled one wraps

    def step():
        model(*inputs).sum().backward()
        for p in model.parameters():
            p.grad = None
    return step


def infer_step(model, x):
    inputs = _inputs(model, x)

    def step():
        with torch.no_grad():
            model(*inputs)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = {}
    for name, (ref, ours, shape) in cases().items():
        x = torch.randn(shape)
        for mode, make in (("fwd_bwd", train_step), ("fwd_no_grad", infer_step)):
            t_ref = per_call_us(make(ref, x), args.calls, args.repeats)
            t_ours = per_call_us(make(ours, x), args.calls, args.repeats)
            rows[f"{name}/{mode}"] = {"torch_nn_us": round(t_ref, 2),
                                      "fusible_us": round(t_ours, 2),
                                      "ratio": round(t_ours / t_ref, 3)}
            print(f"{name:<16} {mode:<12} torch.nn {t_ref:8.1f} us   fusible {t_ours:8.1f} us"
                  f"   ratio {t_ours / t_ref:5.2f}")
        eager = rows[f"{name}/fwd_bwd"]["fusible_us"]
        torch._dynamo.reset()
        t_ref, t_ours = (per_call_us(train_step(torch.compile(m, fullgraph=True), x, m),
                                     args.calls, args.repeats) for m in (ref, ours))
        rows[f"{name}/fwd_bwd_compiled"] = {"torch_nn_us": round(t_ref, 2),
                                            "fusible_us": round(t_ours, 2),
                                            "ratio": round(t_ours / t_ref, 3),
                                            "fusible_eager_us": eager}
        print(f"{name:<16} {'compiled':<12} torch.nn {t_ref:8.1f} us   fusible {t_ours:8.1f} us"
              f"   ratio {t_ours / t_ref:5.2f}   (fusible eager {eager:.1f} us)")
    meta = {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": 1, "calls": args.calls,
            "repeats": args.repeats,
            "target": "ratio <= 1.2; compiled: fusible_us <= torch_nn_us and <= fusible_eager_us"}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
