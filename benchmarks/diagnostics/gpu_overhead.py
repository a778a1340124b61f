"""CPU time (kernel submission) of each stage of the MLP step on a GPU at a small shape."""

import time
from collections import defaultdict

import torch

import fusible.runtime.executor as executor
from fusible import ops

T, H, FF = 2048, 1024, 4096
acc = defaultdict(float)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        acc[name] += time.perf_counter() - t
        return out
    return wrapper


def main():
    model = ops.Sequential(ops.Linear(H, FF), ops.GELU(approximate="tanh"),
                           ops.Linear(FF, H)).to("cuda", torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    model(x).backward(dy)
    for stage in model(x).grad_fn.fusible[0].backward + model(x).grad_fn.fusible[0].forward:
        object.__setattr__(stage, "compute", timed(type(stage.op).__name__ + "." +
                                                   stage.compute.__name__, stage.compute))
    executor.run_forward = timed("run_forward", executor.run_forward)
    executor.run_backward = timed("run_backward", executor.run_backward)
    n = 200
    for _ in range(20):
        model(x).backward(dy)
    torch.cuda.synchronize()
    acc.clear()
    start = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        y = model(x)
        acc["model(x)"] += time.perf_counter() - t
        t = time.perf_counter()
        y.backward(dy)
        acc["y.backward"] += time.perf_counter() - t
    acc["total"] = time.perf_counter() - start
    torch.cuda.synchronize()
    for k, v in acc.items():
        print(f"{k:<45} {v / n * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
